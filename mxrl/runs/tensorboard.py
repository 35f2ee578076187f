"""TensorBoard output of a run record (docs/runs.md, "TensorBoard"): an optional sink.

    require_tensorboard("--tensorboard")    # ValueError naming the fix if it cannot be imported
    attach_tensorboard(record, plan=plan)   # a new run: the plan's audit at step 0
    attach_tensorboard(record, first_step=ckpt_step + 1)   # a resume

The record calls the sink where it writes metrics.jsonl and events.jsonl (`RunRecord.add_sink`):
each metrics row becomes one scalar per metric, named as in metrics.jsonl; each event one text
summary `events/<type>` (its fields as JSON) at its step (0 for an event without one); the plan's
audit one text summary `plan/audit` at step 0. Every write is flushed; `RunRecord.finish` closes
the writer. Each process opens an event file of its own that starts with a session start at
its first step (SummaryWriter's `purge_step`): a resume's file, in the same folder (TensorBoard
reads them as one run), hides what the older files hold from that step on, as `truncate_after`
drops those steps from metrics.jsonl (TensorBoard takes the first file's start as the run's
beginning, not a restart, so a new run writes one at step 0). Needs the `tensorboard` package
(an optional dependency).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from mxrl.runs.jsonl import to_jsonable

TENSORBOARD_DIR = "tensorboard"  # runs/<id>/tensorboard/
AUDIT_TAG = "plan/audit"
EVENT_TAG = "events/{type}"


def require_tensorboard(what: str) -> None:
    """Refuse (ValueError naming `what` and the fix) when the tensorboard package is missing,
    before anything is written."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError(
            f"{what}: TensorBoard output needs the tensorboard package, which this Python "
            "cannot import; pip install tensorboard (or turn TensorBoard output off)"
        ) from None


def plan_audit(plan: Any) -> str:
    """The audit of a `mxrl.recipe.Plan`: its table (a line per tensor, a summary) and hash."""
    return f"{plan.table()}\nplan hash: {plan.hash()}"


class TensorBoardSink:
    """A `torch.utils.tensorboard.SummaryWriter` fed by a RunRecord (`metrics`, `event`, `close`)."""

    def __init__(
        self, log_dir: str | os.PathLike[str], *, audit: str | None = None,
        purge_step: int | None = None,
    ) -> None:  # fmt: skip
        from tensorboard.plugins.text.summary_v2 import text_pb
        from torch.utils.tensorboard import SummaryWriter

        self._text_pb = text_pb
        self.writer = SummaryWriter(os.fspath(log_dir), purge_step=purge_step)
        if audit is not None:
            self._text(AUDIT_TAG, audit, 0)

    def metrics(self, step: int, row: Mapping[str, float]) -> None:
        for name, value in row.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def event(self, event: Mapping[str, Any]) -> None:
        fields = {k: v for k, v in event.items() if k not in ("type", "step")}
        text = json.dumps(to_jsonable(fields, f"event {event['type']!r}"), indent=2)
        self._text(EVENT_TAG.format(type=event["type"]), text, event.get("step") or 0)

    def close(self) -> None:
        self.writer.close()

    def _text(self, tag: str, text: str, step: int) -> None:
        """A text summary under `tag` itself (SummaryWriter.add_text appends /text_summary),
        as a markdown code block (TensorBoard renders text as markdown)."""
        block = "\n".join("    " + line for line in text.splitlines())
        self.writer.file_writer.add_summary(self._text_pb(tag, block), step)
        self.writer.flush()


def attach_tensorboard(record: Any, *, plan: Any = None, first_step: int = 0) -> TensorBoardSink:
    """A TensorBoardSink writing into record.path/tensorboard/, added to `record`'s sinks; with
    `plan`, its audit at step 0 (a new run); `first_step`: the first step a resume trains."""
    sink = TensorBoardSink(
        record.path / TENSORBOARD_DIR,
        audit=None if plan is None else plan_audit(plan),
        purge_step=first_step,
    )
    record.add_sink(sink)
    return sink
