"""RunRecord: one run's folder, written append-only while the loop runs (docs/runs.md).

    rec = RunRecord.create("runs", config=cfg, plan_json=plan.to_json(), backend=backend)
    rec.log_metrics(step, {"reward/mean": 0.41, "mismatch/k3": 2e-4, ...})
    rec.log_quantization(export.event)          # a QuantizationEvent (or its dict)
    rec.log_sync_verified(step, version=report.version, plan_hash=h, ok=True)
    rec.note("lr warmup looks too short")
    rec.finish(step)

    rec.add_sink(sink)   # e.g. mxrl.runs.tensorboard.TensorBoardSink: fed each metrics row and event

    rec = RunRecord.open("runs/20250601-120304-a1b2")   # reading never modifies it
    rec.resume(ckpt_step, checkpoint=path, config=cfg, changes=[{"field": "rl.lr", ...}])

Layout of runs/<id>/: config.yaml (the config the run uses; rewritten by a resume), plan.json, env.json, metrics.jsonl (one object
per step), events.jsonl (typed events), notes.md. Every write appends and flushes; readers skip a
line truncated by a killed writer and report it once (logging), and the next append drops it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import secrets
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from mxrl.runs.ending import (  # noqa: F401  (the record's public names)
    END,
    FAILED,
    FINISHED,
    INTERRUPTED,
    RunEnding,
    RunInterrupted,
)
from mxrl.runs.env import capture_env, utc_now
from mxrl.runs.jsonl import ReadResult, append_line, repair_tail, rewrite, to_float, to_jsonable
from mxrl.runs.read import (
    CONFIG_FILE,
    ENV_FILE,
    EVENTS_FILE,
    METRICS_FILE,
    NOTES_FILE,
    PLAN_FILE,
    RunReading,
    is_run_dir,
)
from mxrl.runs.yamlio import dump_yaml

logger = logging.getLogger(__name__)

# event types with a logging helper below (others are free-form: log_event("my_type", ...))
QUANTIZATION = "quantization"
SPIKE = "spike"
RESUME = "resume"
CONFIG_CHANGE = "config_change"
SKIPPED_ROWS = "skipped_rows"
SYNC_VERIFIED = "sync_verified"
NOTE = "note"

RESERVED_EVENT_KEYS = ("type", "step", "time")
MAX_SKIP_REASONS = 10


def new_run_id() -> str:
    """UTC timestamp + 4 hex characters, e.g. 20250601-120304-a1b2 (sorts by start time)."""
    return dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def _check_run_id(run_id: str) -> str:
    if (
        not isinstance(run_id, str)
        or not run_id.strip()
        or run_id in (".", "..")
        or "/" in run_id
        or os.sep in run_id
    ):
        raise ValueError(f"run_id {run_id!r} must be a non-empty folder name without '/'")
    return run_id


def _check_step(step: Any, what: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{what}: step must be an int >= 0, got {step!r}")
    return step


def check_writable(path: str | os.PathLike[str], what: str) -> None:
    """Refuse (ValueError naming `what`) a folder that cannot be created or written to, before
    any work, creating nothing: the nearest existing ancestor must be a folder in which a
    folder can be made (a probe, removed at once)."""
    path = Path(path)
    anchor = path
    while not anchor.exists() and anchor.parent != anchor:
        anchor = anchor.parent
    if not anchor.is_dir():
        where = "is a file" if anchor == path else f"lies under {str(anchor)!r}, a file"
        raise ValueError(f"{what}: {str(path)!r} {where}, not a folder; pass a folder path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mxrl-probe-", dir=anchor))
    except OSError as e:
        raise ValueError(
            f"{what}: {str(path)!r} cannot be written (in {str(anchor)!r}: "
            f"{e.strerror or e}); pass a folder you can write to"
        ) from None


class Sink(Protocol):
    """Another output of the record (`RunRecord.add_sink`): it sees every metrics row and event
    as written to metrics.jsonl and events.jsonl, and is closed by `finish`."""

    def metrics(self, step: int, row: Mapping[str, float]) -> None: ...

    def event(self, event: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class RunRecord(RunReading, RunEnding):
    """A run folder. Build with `create` (new run) or `open` (read it, or resume: appends)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._repaired: set[str] = set()
        self._reported: dict[str, str] = {}  # problem key -> message, each logged once
        self._cache: dict[str, tuple[tuple[int, int], ReadResult]] = {}
        self._ended = False  # this process recorded the run's end
        self.sinks: list[Sink] = []  # fed by log_metrics and log_event, closed by finish

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        root: str | os.PathLike[str] = "runs",
        run_id: str | None = None,
        *,
        config: Mapping[str, Any] | Any | None = None,
        plan_json: str | Any | None = None,
        backend: str | None = None,
    ) -> RunRecord:
        """Make root/<run_id>/ and write config.yaml, plan.json (if given), env.json, notes.md.

        run_id: default `new_run_id()`. An existing folder is never overwritten (ValueError).
        config: the run's config, a mapping or a dataclass (nested dataclasses, enums, paths,
        tuples are converted to plain YAML); written once. plan_json: `Plan.to_json()` text, any JSON string, or an object
        with a `to_json()` method. backend: the kernel backend, recorded in env.json.
        """
        run_id = _check_run_id(run_id if run_id is not None else new_run_id())
        config_data = to_jsonable(config if config is not None else {}, "config")
        if not isinstance(config_data, dict):
            raise TypeError(f"config must be a mapping or a dataclass, got {type(config).__name__}")
        plan_text = None
        if plan_json is not None:
            plan_text = plan_json if isinstance(plan_json, str) else plan_json.to_json(indent=2)
            try:
                json.loads(plan_text)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"plan_json is not valid JSON ({e}); pass Plan.to_json()"
                ) from None
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        path = root / run_id
        try:
            path.mkdir()
        except FileExistsError:
            raise ValueError(
                f"run directory {str(path)!r} already exists; choose another run_id, or "
                "RunRecord.open() it to resume"
            ) from None
        (path / CONFIG_FILE).write_text(dump_yaml(config_data))
        if plan_text is not None:
            (path / PLAN_FILE).write_text(plan_text.rstrip("\n") + "\n")
        env = capture_env(backend)
        (path / ENV_FILE).write_text(json.dumps(to_jsonable(env), indent=2) + "\n")
        (path / NOTES_FILE).write_text(f"# Notes: run {run_id}\n")
        for name in (METRICS_FILE, EVENTS_FILE):
            (path / name).touch()
        logger.info("run record %s", path)
        return cls(path)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> RunRecord:
        """An existing run. Opening and reading never modify it; writes append (a resume:
        `resume`, once every check of the resume has passed)."""
        path = Path(path)
        if not is_run_dir(path):
            raise ValueError(
                f"{str(path)!r} is not a run directory (no {CONFIG_FILE} or {ENV_FILE})"
            )
        return cls(path)

    def resume(
        self,
        step: int,
        *,
        checkpoint: str | os.PathLike[str] | None = None,
        backend: str | None = None,
        config: Mapping[str, Any] | Any | None = None,
        changes: Sequence[Mapping[str, Any]] = (),
    ) -> dict[str, Any]:
        """Continue the run from its checkpoint of `step`; call it only once everything that
        can refuse the resume has passed (nothing here checks the run can continue).

        Drops the metrics and events of later steps (`truncate_after`: the resumed run logs
        each of them once), rewrites config.yaml to `config` (the config the run continues
        with) when given, moves the `end` event of the process that stopped at `step` into
        the `resume` event it writes at `step` (`previous_end`, with the checkpoint path and
        the new process's environment), then one `config_change` event per entry of `changes`
        (`field`, `old`, `new`) at step + 1, the first step that uses the new value. Returns
        the resume event."""
        step = _check_step(step, "resume")
        self.truncate_after(step)
        # the end of the process that stopped at `step` (finished, failed at it): kept in the
        # resume event, so `runs list` sees the run going on, not its old end
        ended = self.events(END)
        if ended:
            self._drop(EVENTS_FILE, lambda r: r.get("type") == END)
        if config is not None:
            data = to_jsonable(config, "config")
            if not isinstance(data, dict):
                raise TypeError(f"config must be a mapping or a dataclass, got {type(config)}")
            tmp = self.path / (CONFIG_FILE + ".tmp")
            tmp.write_text(dump_yaml(data))
            tmp.replace(self.path / CONFIG_FILE)
        event = self.log_event(
            RESUME,
            step,
            from_step=step,
            checkpoint=None if checkpoint is None else os.fspath(checkpoint),
            env=capture_env(backend),
            previous_end={k: v for k, v in ended[-1].items() if k != "type"} if ended else None,
        )
        for change in changes:
            self.log_event(
                CONFIG_CHANGE,
                step + 1,
                field=str(change["field"]),
                old=to_jsonable(change["old"], "old"),
                new=to_jsonable(change["new"], "new"),
            )
        return event

    # -- what was written once -----------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self.path.name

    # -- writing --------------------------------------------------------------------------------

    def add_sink(self, sink: Sink) -> None:
        """From now on, `sink` gets each metrics row and event this process writes (after its
        line is written) until `finish` closes it."""
        self.sinks.append(sink)

    def _append(self, name: str, obj: Mapping[str, Any]) -> None:
        path = self.path / name
        if name not in self._repaired:
            dropped = repair_tail(path)
            if dropped:
                logger.warning(
                    "%s: dropped a truncated last line (%d bytes) before appending", path, dropped
                )
            self._repaired.add(name)
        append_line(path, obj)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One line of metrics.jsonl: {"step": step, **metrics}; values become floats (NaN and
        Inf are written as the strings "nan", "inf", "-inf" and read back as floats)."""
        _check_step(step, "log_metrics")
        row: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            if key == "step":
                raise ValueError("log_metrics: pass the step as the first argument, not a key")
            row[str(key)] = to_float(value, str(key))
        self._append(METRICS_FILE, row)
        for sink in self.sinks:
            sink.metrics(step, {k: v for k, v in row.items() if k != "step"})

    def log_event(self, type: str, step: int | None, **fields: Any) -> dict[str, Any]:
        """One line of events.jsonl: {"type", "step", "time", **fields}; returns it."""
        if not isinstance(type, str) or not type.strip():
            raise ValueError(f"event type must be a non-empty string, got {type!r}")
        if step is not None:
            _check_step(step, f"event {type!r}")
        clash = [k for k in fields if k in RESERVED_EVENT_KEYS]
        if clash:
            raise ValueError(f"event {type!r}: {clash} are set by log_event; rename the field(s)")
        event = {"type": type, "step": step, "time": utc_now(), **fields}
        self._append(EVENTS_FILE, event)
        for sink in self.sinks:
            sink.event(event)
        return event

    def log_quantization(self, event: Any) -> dict[str, Any]:
        """A `mxrl.sync.QuantizationEvent` (or its `to_dict()`); read it back with
        `QuantizationEvent.from_dict(record.events("quantization")[i])`."""
        data = dict(event.to_dict() if hasattr(event, "to_dict") else event)
        step = data.pop("step")
        return self.log_event(QUANTIZATION, int(step), **data)

    def log_spike(
        self,
        step: int,
        grad_norm: float,
        z: float,
        top_layers: Mapping[str, float] | Sequence[tuple[str, float]] = (),
        **fields: Any,
    ) -> dict[str, Any]:
        """A gradient-norm spike: the norm, its z-score, the layers that explain it ({name:
        value} or (name, value) pairs, e.g. `mxrl.rl.stability.top_growth`'s growth ratios)."""
        top = dict(top_layers.items() if isinstance(top_layers, Mapping) else top_layers)
        top = {str(k): to_float(v, f"top_layers.{k}") for k, v in top.items()}
        return self.log_event(
            SPIKE,
            step,
            grad_norm=to_float(grad_norm, "grad_norm"),
            z=to_float(z, "z"),
            top_layers=top,
            **fields,
        )

    def log_skipped_rows(
        self, step: int, count: int, reasons: Sequence[str] = (), **fields: Any
    ) -> dict[str, Any]:
        """Dataset rows skipped (bad prompt, no answer...): the count and the first reasons."""
        return self.log_event(
            SKIPPED_ROWS,
            step,
            count=int(count),
            reasons=[str(r) for r in list(reasons)[:MAX_SKIP_REASONS]],
            **fields,
        )

    def log_sync_verified(
        self, step: int, version: int, plan_hash: str, ok: bool, **fields: Any
    ) -> dict[str, Any]:
        """One weight sync checked by hashes (ok False: the engine refused the update)."""
        return self.log_event(
            SYNC_VERIFIED,
            step,
            version=int(version),
            plan_hash=str(plan_hash),
            ok=bool(ok),
            **fields,
        )

    def note(self, text: str, step: int | None = None) -> None:
        """Append a human note to notes.md under a UTC timestamp heading."""
        text = str(text).strip()
        if not text:
            raise ValueError("note: the text is empty")
        heading = f"## {utc_now()}" + ("" if step is None else f" (step {step})")
        with open(self.path / NOTES_FILE, "a", encoding="utf-8") as f:
            f.write(f"\n{heading}\n\n{text}\n")
            f.flush()

    def truncate_after(self, step: int) -> tuple[int, int]:
        """Drop metrics and events of steps > `step` (resuming from a checkpoint taken at `step`,
        so the resumed run logs each later step exactly once). Events without a step are kept.
        Returns (metric lines dropped, event lines dropped)."""
        _check_step(step, "truncate_after")
        dropped = [
            self._drop(name, lambda r: _after(r.get("step"), step))
            for name in (METRICS_FILE, EVENTS_FILE)
        ]
        if any(dropped):
            logger.info(
                "%s: dropped %d metric and %d event lines after step %d",
                self.path,
                dropped[0],
                dropped[1],
                step,
            )
        return dropped[0], dropped[1]

    def _drop(self, name: str, drop: Callable[[dict[str, Any]], bool]) -> int:
        """Rewrite one JSON-lines file without the records `drop` selects; returns how many."""
        records = self._read(name).records
        keep = [r for r in records if not drop(r)]
        path = self.path / name
        if path.exists():
            rewrite(path, keep)  # also drops a truncated last line and unreadable lines
        self._repaired.add(name)
        self._cache.pop(name, None)
        return len(records) - len(keep)

    def __repr__(self) -> str:
        return f"RunRecord({str(self.path)!r})"


def _after(step: Any, limit: int) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and step > limit
