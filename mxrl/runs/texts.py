"""The texts of `mxrl runs list` and `mxrl runs show` (a run's summary, `mxrl.runs.summary`, put
into words) and the number formats the comparison report shares. Functions here return strings;
the CLI prints them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from mxrl.runs import health
from mxrl.runs.record import CONFIG_FILE, END, RunRecord
from mxrl.runs.summary import RunSummary, summarize

DASH = "—"


def fmt(value: float | None) -> str:
    if value is None:
        return DASH
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"


def _date(start: str | None) -> str:
    return start[:16].replace("T", " ") if isinstance(start, str) else DASH


def format_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    rows = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def format_list(records: Sequence[RunRecord]) -> str:
    """The table of `mxrl runs list`; a run that cannot be read is a row marked `unreadable`,
    and every run with problems (that, missing files, skipped lines) is named below it."""
    header = ("id", "recipe", "steps", "last reward", "status", "started (UTC)")
    rows, notes = [], []
    for r in records:
        problems = health.problems(r)
        if problems:
            notes.append(f"  {r.run_id}: {'; '.join(problems)}")
        if health.unreadable(r):
            rows.append(
                (r.run_id, DASH, DASH, DASH, "unreadable", _date(health.start_key(r) or None))
            )
            continue
        s = summarize(r)
        rows.append(
            (
                r.run_id,
                s.recipe or DASH,
                str(s.num_steps),
                fmt(s.final.get("reward/mean")),
                s.status,
                _date(s.start_time),
            )
        )
    table = format_table(header, rows)
    return table if not notes else "\n".join([table, "", "problems reading runs:", *notes])


def _flatten(data: Any, prefix: str = "") -> list[tuple[str, str]]:
    if isinstance(data, dict) and data:
        out = []
        for k, v in data.items():
            out += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    text = str(data)
    return [(prefix, text if len(text) <= 80 else text[:77] + "...")]


def _env_lines(env: dict[str, Any]) -> list[str]:
    if not env:
        return ["  (no env.json)"]
    git = env.get("git") or {}
    dirty = {True: " (dirty)", False: "", None: ""}.get(git.get("dirty"), "")
    versions = env.get("versions") or {}
    device = env.get("device") or {}
    cuda = device.get("cuda_devices") or []
    gpus = f"{len(cuda)}x {cuda[0]}" if cuda else "none"
    return [
        f"  commit:   {git.get('commit', 'unknown')}{dirty}",
        "  versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        f"  device:   cpu {device.get('cpu', DASH)}; cuda {gpus}",
        f"  backend:  {env.get('backend') or DASH}; host {env.get('hostname', DASH)}",
        f"  started:  {env.get('start_time', DASH)}",
    ]


def format_show(record: RunRecord, max_config_lines: int = 40) -> str:
    """The text of `mxrl runs show`; ValueError (one line) for a run that cannot be read."""
    health.refuse_unreadable(record)
    s = summarize(record)
    steps = DASH if s.last_step is None else f"last step {s.last_step}"
    lines = [
        f"run {record.run_id}  ({record.path})",
        f"status: {s.status}; {s.num_steps} steps logged, {steps}; recipe {s.recipe or DASH}",
    ]
    ends = record.events(END)
    if ends and ends[-1].get("error"):
        lines.append(f"error: {ends[-1]['error']}")
    lines += ["", "config:"]
    flat = _flatten(record.config)
    lines += [f"  {k}: {v}" for k, v in flat[:max_config_lines]] or ["  (empty)"]
    if len(flat) > max_config_lines:
        lines.append(f"  ... {len(flat) - max_config_lines} more in {CONFIG_FILE}")
    plan = record.plan_json
    if plan is not None:
        lines += ["", f"plan: {_plan_line(plan)}"]
    lines += ["", "env:", *_env_lines(record.env), ""]
    rows = record.metrics()
    if rows:
        last = rows[-1]
        lines.append(f"last metrics (step {last['step']}):")
        width = max(len(k) for k in last)
        lines += [f"  {k:<{width}}  {fmt(v)}" for k, v in last.items() if k != "step"]
    else:
        lines.append("last metrics: none logged")
    lines.append("")
    counts = ", ".join(f"{k} {v}" for k, v in sorted(s.event_counts.items())) or "none"
    lines.append(f"events: {counts}")
    lines.append(f"gradient spikes: {spikes_line(s)}")
    lines.append(f"weight syncs verified: {syncs_line(s)}")
    body = [ln for ln in record.notes().splitlines() if not ln.startswith("# ")]
    while body and not body[0].strip():
        body.pop(0)
    lines += ["", "notes:", *(f"  {ln}".rstrip() for ln in body)] if body else ["", "notes: none"]
    problems = health.problems(record)
    if problems:
        lines += ["", "problems reading the record:", *(f"  {p}" for p in problems)]
    return "\n".join(lines).rstrip() + "\n"


def _plan_line(plan_text: str) -> str:
    import json

    try:
        plan = json.loads(plan_text)
    except json.JSONDecodeError:
        return "plan.json is not valid JSON"
    if not isinstance(plan, dict):
        return "plan.json (not an object)"
    parts = [str(plan[k]) for k in ("recipe_name", "backward") if k in plan]
    if "hash" in plan:
        parts.append(f"hash {plan['hash']}")
    if isinstance(plan.get("tensors"), list):
        parts.append(f"{len(plan['tensors'])} tensors")
    return ", ".join(parts) or "plan.json"


def spikes_line(s: RunSummary) -> str:
    if not s.spike_steps:
        return "0"
    shown = ", ".join(str(x) for x in s.spike_steps[:8])
    more = ", ..." if len(s.spike_steps) > 8 else ""
    return f"{len(s.spike_steps)} (steps {shown}{more})"


def syncs_line(s: RunSummary, markdown: bool = False) -> str:
    if s.syncs_verified is None:
        return DASH
    word = "yes" if s.syncs_verified else ("**no**" if markdown else "NO")
    return f"{word} ({s.num_syncs_ok}/{s.num_syncs})"
