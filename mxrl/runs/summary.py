"""Numbers of a run (final and mean of metrics, spikes, syncs) and finding runs; the CLI texts
are in `mxrl.runs.texts`.
"""

from __future__ import annotations

import datetime as dt
import difflib
import math
import os
import socket
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxrl.runs import health
from mxrl.runs.record import (
    CONFIG_FILE,
    END,
    ENV_FILE,
    EVENTS_FILE,
    FAILED,
    FINISHED,
    INTERRUPTED,
    METRICS_FILE,
    QUANTIZATION,
    RESUME,
    SKIPPED_ROWS,
    SPIKE,
    SYNC_VERIFIED,
    RunRecord,
)

# The metric keys the loop logs every step (docs/runs.md has their meaning).
METRIC_KEYS = (
    "reward/mean",
    "reward/std",
    "accuracy",
    "response_len/mean",
    "mismatch/k1",
    "mismatch/k3",
    "mismatch/logp_abs_diff_mean",
    "mismatch/logp_abs_diff_max",
    "loss/clip_frac",
    "grad/norm",
    "grad/spike",
    "time/rollout_s",
    "time/train_s",
    "time/sync_s",
    "throughput/tokens_per_s",
)
TIME_KEYS = ("time/rollout_s", "time/train_s", "time/sync_s")
ACTIVE_WITHIN_S = 15 * 60  # no end event and a write this recent: "active", else "unfinished"


@dataclass
class RunSummary:
    """What `list`, `show` and `compare` say about one run. final/mean/max: per metric key, over
    the steps that logged it (mean and max over finite values; NaN when none is finite)."""

    record: RunRecord
    recipe: str | None
    num_steps: int
    last_step: int | None
    start_time: str | None
    status: str
    final: dict[str, float] = field(default_factory=dict)
    mean: dict[str, float] = field(default_factory=dict)
    max: dict[str, float] = field(default_factory=dict)
    spike_steps: list[int] = field(default_factory=list)
    num_syncs: int = 0
    num_syncs_ok: int = 0
    num_quantization: int = 0
    last_min_sqnr_db: float | None = None
    num_skipped_rows: int = 0
    event_counts: dict[str, int] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.record.run_id

    @property
    def syncs_verified(self) -> bool | None:
        """True: every sync verified; False: at least one failed; None: no sync recorded."""
        return None if self.num_syncs == 0 else self.num_syncs_ok == self.num_syncs


def _num(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def is_step_row(row: dict[str, Any]) -> bool:
    """A metrics row of a training step: one holding more than `eval/` keys. The loop logs the
    starting policy's held-out accuracy as a row of its own at step 0 (`eval_every`), which is
    not a step: a 140-step run has 141 rows and 140 steps."""
    return any(k != "step" and not k.startswith("eval/") for k in row)


def summarize(record: RunRecord) -> RunSummary:
    """The numbers of a readable run (`health.refuse_unreadable` first for one that may not
    be)."""
    rows = record.metrics()
    events = record.events()
    steps = [r["step"] for r in rows if is_step_row(r)]
    s = RunSummary(
        record=record,
        recipe=record.recipe,
        num_steps=len(steps),
        last_step=max(steps, default=None),
        start_time=record.env.get("start_time"),
        status=_status(record, events),
    )
    values: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if k != "step":
                values.setdefault(k, []).append(v)
                s.final[k] = v
    for k, vs in values.items():
        finite = [v for v in vs if math.isfinite(v)]
        s.mean[k] = sum(finite) / len(finite) if finite else math.nan
        s.max[k] = max(finite) if finite else math.nan
    spikes = {r["step"] for r in rows if r.get("grad/spike", 0.0) > 0}
    spikes |= {
        e["step"] for e in events if e.get("type") == SPIKE and isinstance(e.get("step"), int)
    }
    s.spike_steps = sorted(spikes)
    syncs = [e for e in events if e.get("type") == SYNC_VERIFIED]
    s.num_syncs, s.num_syncs_ok = len(syncs), sum(1 for e in syncs if e.get("ok") is True)
    quant = [e for e in events if e.get("type") == QUANTIZATION]
    s.num_quantization = len(quant)
    if quant:
        sqnr = [_num(v) for v in (quant[-1].get("sqnr_db") or {}).values()]
        sqnr = [v for v in sqnr if v is not None]
        s.last_min_sqnr_db = min(sqnr) if sqnr else None
    s.num_skipped_rows = sum(
        int(_num(e.get("count")) or 0) for e in events if e.get("type") == SKIPPED_ROWS
    )
    s.event_counts = dict(Counter(str(e.get("type")) for e in events))
    return s


def _status(record: RunRecord, events: Sequence[dict[str, Any]]) -> str:
    """finished / failed (step) / interrupted (signal) from the END event; without one:
    running (its process is alive on this host), else unfinished (it died unrecorded:
    SIGKILL, out of memory, power); for another host, the age of the last write decides."""
    ends = [e for e in events if e.get("type") == END]
    if ends:
        end = ends[-1]
        status = str(end.get("status", FINISHED))
        status = FINISHED if status == "done" else status  # records written before 2026-11-30
        step = end.get("step")
        if status == FAILED:
            return "failed before step 1" if not step else f"failed at step {step}"
        if status == INTERRUPTED:
            return f"interrupted ({end.get('signal', 'signal')}) at step {step}"
        return status
    alive = _process_alive(record, events)
    if alive is not None:
        return "running" if alive else "unfinished"
    last_write = max(
        (
            p.stat().st_mtime
            for p in (record.path / n for n in (METRICS_FILE, EVENTS_FILE))
            if p.exists()
        ),
        default=0.0,
    )
    age = dt.datetime.now(dt.UTC).timestamp() - last_write
    return "active" if age < ACTIVE_WITHIN_S else "unfinished"


def _process_alive(record: RunRecord, events: Sequence[dict[str, Any]]) -> bool | None:
    """Whether the run's latest process (the last resume's, else the creator's) still runs;
    None when that is not knowable here (another host, or a record without a pid)."""
    env = record.env
    for e in reversed(events):
        if e.get("type") == RESUME and isinstance(e.get("env"), dict):
            env = e["env"]
            break
    pid = env.get("pid")
    if not isinstance(pid, int) or env.get("hostname") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


# -- finding runs --------------------------------------------------------------------------------


def find_runs(root: str | os.PathLike[str]) -> list[RunRecord]:
    """The runs under root, newest first (by start time in env.json, else folder time). A run
    folder that cannot be read is listed too (`format_list` marks it)."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"no runs folder {str(root)!r}; pass --root DIR (where the runs are)")
    try:
        records = [RunRecord(p) for p in root.iterdir() if health.looks_like_run(p)]
    except OSError as e:
        raise ValueError(f"cannot list the runs folder {str(root)!r}: {e.strerror}") from None
    return sorted(records, key=lambda r: (health.start_key(r), r.run_id), reverse=True)


def resolve_run(ref: str | os.PathLike[str], root: str | os.PathLike[str] = "runs") -> RunRecord:
    """A run by path, by id under root, or by a unique prefix (else unique part) of an id, e.g.
    the random suffix; ValueError listing the nearest ids otherwise."""
    if isinstance(ref, RunRecord):
        return ref
    path = Path(ref)
    if health.looks_like_run(path):
        return RunRecord(path)
    root = Path(root)
    if health.looks_like_run(root / path):
        return RunRecord(root / path)
    ids = (
        sorted(p.name for p in root.iterdir() if health.looks_like_run(p)) if root.is_dir() else []
    )
    text = os.fspath(ref)
    matches = [i for i in ids if i.startswith(text)] or [i for i in ids if text in i]
    if len(matches) == 1:
        return RunRecord(root / matches[0])
    if len(matches) > 1:
        raise ValueError(f"run {text!r} is ambiguous under {str(root)!r}: {', '.join(matches)}")
    if not ids:
        raise ValueError(
            f"no run {text!r}: {str(root)!r} holds no runs (a run folder has {CONFIG_FILE} or "
            f"{ENV_FILE}); pass --root DIR or a path"
        )
    near = difflib.get_close_matches(text, ids, n=5, cutoff=0.4)
    hint = f"nearby: {', '.join(near)}" if near else f"runs there: {', '.join(ids[-5:])}"
    raise ValueError(f"no run {text!r} under {str(root)!r}; {hint}")
