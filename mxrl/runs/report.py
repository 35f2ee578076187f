"""Compare runs: PNG plots (one figure per subject, one series per run: `mxrl.runs.plots`) and
comparison.md.

    result = compare(["runs/bf16-a", "runs/nvfp4-b"], "reports/ablation")
    result.figures  # {"reward": Path(".../reward.png"), ...}; a figure without data is skipped

Figures: heldout (eval/accuracy: greedy accuracy on a held-out set, logged every few steps),
reward (reward/mean; accuracy too where it is not the same numbers), mismatch
(mismatch/k3, mismatch/k1; log scale when every value is positive), grad_norm (grad/norm, spikes
marked from the grad/spike metric and spike events), step_time (mean time/rollout_s,
time/train_s, time/sync_s per run, stacked). Series are labelled by config recipe, else by run
id. Runs of one recipe (seeds) are drawn as one line, their mean per step, with a band of one
standard error of that mean over the seeds; a single run is a plain line. Steps are integers.
`mxrl.runs.plots` draws them (matplotlib's `Figure` and Agg canvas: no pyplot, no display).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mxrl.runs import health
from mxrl.runs.env import utc_now
from mxrl.runs.plots import PLOTS, RunSeries
from mxrl.runs.record import RunRecord
from mxrl.runs.summary import TIME_KEYS, RunSummary, summarize
from mxrl.runs.texts import DASH, fmt, spikes_line, syncs_line

logger = logging.getLogger(__name__)

COMPARISON_FILE = "comparison.md"
FIGURES = ("heldout", "reward", "mismatch", "grad_norm", "step_time")
_DPI = 110


@dataclass(frozen=True)
class Comparison:
    """What `compare` wrote. figures: name -> PNG path, for the figures that had data;
    skipped: names of figures without data; problems: what the readers skipped (and missing
    files), per run; unreadable: the runs left out because a file of theirs cannot be read or
    parsed (`health.unreadable`), per run."""

    out_dir: Path
    markdown: Path
    table: str
    figures: dict[str, Path] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()
    problems: dict[str, list[str]] = field(default_factory=dict)
    unreadable: dict[str, list[str]] = field(default_factory=dict)


def _labels(records: Sequence[RunRecord]) -> list[str]:
    """config recipe when it names runs apart; "recipe [id]" for repeats; else the run id."""
    recipes = [r.recipe for r in records]
    labels = []
    for record, recipe in zip(records, recipes, strict=True):
        if recipe is None:
            labels.append(record.run_id)
        elif recipes.count(recipe) > 1:
            labels.append(f"{recipe} [{record.run_id}]")
        else:
            labels.append(recipe)
    return labels


def compare(
    runs: Sequence[str | os.PathLike[str] | RunRecord], out_dir: str | os.PathLike[str]
) -> Comparison:
    """Write the figures and comparison.md for `runs` (run folders or RunRecords) into out_dir.
    A run that cannot be read is left out with a warning (`Comparison.unreadable`, and a
    section of comparison.md); ValueError, before anything is written, when none is left."""
    from matplotlib import colormaps

    if not runs:
        raise ValueError("compare: give at least one run")
    records = [r if isinstance(r, RunRecord) else RunRecord.open(r) for r in runs]
    records, unreadable = health.split_readable(records, "compare")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    palette = colormaps["tab10"]
    loaded = [
        RunSeries(label, palette(i % 10), summarize(rec), rec.metrics(), rec.events())
        for i, (rec, label) in enumerate(zip(records, _labels(records), strict=True))
    ]
    figures: dict[str, Path] = {}
    skipped = []
    for name, plot in PLOTS.items():
        fig = plot(loaded)
        if fig is None:
            skipped.append(name)
            continue
        path = out / f"{name}.png"
        fig.savefig(path, dpi=_DPI)
        figures[name] = path
    table = comparison_table([r.summary for r in loaded], [r.label for r in loaded])
    problems = {r.summary.run_id: health.problems(r.summary.record) for r in loaded}
    problems = {k: v for k, v in problems.items() if v}
    markdown = out / COMPARISON_FILE
    markdown.write_text(_markdown(loaded, table, figures, skipped, problems, unreadable))
    return Comparison(out, markdown, table, figures, tuple(skipped), problems, unreadable)


# -- the table -------------------------------------------------------------------------------

# (row label, cell of one run's summary)
_ROWS: list[tuple[str, Callable[[RunSummary], str]]] = [
    ("run id", lambda s: f"`{s.run_id}`"),
    ("recipe", lambda s: s.recipe or DASH),
    ("steps logged", lambda s: str(s.num_steps)),
    ("reward/mean, final", lambda s: fmt(s.final.get("reward/mean"))),
    ("reward/mean, mean", lambda s: fmt(s.mean.get("reward/mean"))),
    ("accuracy, final", lambda s: fmt(s.final.get("accuracy"))),
    ("accuracy, mean", lambda s: fmt(s.mean.get("accuracy"))),
    ("eval/accuracy (held-out), final", lambda s: fmt(s.final.get("eval/accuracy"))),
    ("response_len/mean, mean", lambda s: fmt(s.mean.get("response_len/mean"))),
    ("mismatch/k3, final", lambda s: fmt(s.final.get("mismatch/k3"))),
    ("mismatch/k3, mean", lambda s: fmt(s.mean.get("mismatch/k3"))),
    ("mismatch/k1, mean", lambda s: fmt(s.mean.get("mismatch/k1"))),
    ("mismatch/logp_abs_diff_mean, mean", lambda s: fmt(s.mean.get("mismatch/logp_abs_diff_mean"))),
    ("mismatch/logp_abs_diff_max, max", lambda s: fmt(s.max.get("mismatch/logp_abs_diff_max"))),
    ("loss/clip_frac, mean", lambda s: fmt(s.mean.get("loss/clip_frac"))),
    ("grad/norm, mean", lambda s: fmt(s.mean.get("grad/norm"))),
    ("grad/norm, max", lambda s: fmt(s.max.get("grad/norm"))),
    ("gradient spikes", spikes_line),
    ("weight syncs verified", lambda s: syncs_line(s, markdown=True)),
    ("quantization events", lambda s: str(s.num_quantization) if s.num_quantization else DASH),
    ("min layer SQNR at last export (dB)", lambda s: fmt(s.last_min_sqnr_db)),
    ("skipped dataset rows", lambda s: str(s.num_skipped_rows)),
    ("step time, mean (s)", lambda s: _step_time(s)),
    (
        "rollout / train / sync, mean (s)",
        lambda s: " / ".join(fmt(s.mean.get(k)) for k in TIME_KEYS),
    ),
    ("throughput/tokens_per_s, mean", lambda s: fmt(s.mean.get("throughput/tokens_per_s"))),
    ("status", lambda s: s.status),
]


def _step_time(s: RunSummary) -> str:
    parts = [s.mean[k] for k in TIME_KEYS if k in s.mean and math.isfinite(s.mean[k])]
    return fmt(sum(parts)) if parts else DASH


def comparison_table(summaries: Sequence[RunSummary], labels: Sequence[str]) -> str:
    """Markdown: one column per run, one row per number ("—" where a run lacks the metric)."""
    header = "| metric | " + " | ".join(_cell(label) for label in labels) + " |"
    align = "|---|" + "---:|" * len(labels)
    lines = [header, align]
    for name, cell in _ROWS:
        lines.append(f"| {name} | " + " | ".join(_cell(cell(s)) for s in summaries) + " |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _markdown(
    runs: Sequence[RunSeries],
    table: str,
    figures: dict[str, Path],
    skipped: Sequence[str],
    problems: dict[str, list[str]],
    unreadable: dict[str, list[str]],
) -> str:
    lines = [
        "# Run comparison",
        "",
        f"{len(runs)} run(s), written {utc_now()} by `mxrl runs compare`. Final: the last step "
        "that logged the metric; mean and max: over its finite values.",
        "",
        table,
        "",
    ]
    if figures:
        lines += ["## Plots", ""]
        for name, path in figures.items():
            lines += [f"![{name}]({path.name})", ""]
    if skipped:
        lines += [f"Not plotted (no run logged the metrics): {', '.join(skipped)}.", ""]
    lines += ["## Runs", ""]
    for r in runs:
        env = r.summary.record.env
        git = env.get("git") or {}
        device = env.get("device") or {}
        cuda = device.get("cuda_devices") or []
        where = f"{len(cuda)}x {cuda[0]}" if cuda else f"cpu {device.get('cpu', DASH)}"
        dirty = " (dirty)" if git.get("dirty") else ""
        lines.append(
            f"- **{r.label}**: `{r.summary.record.path}`, commit `{git.get('commit', 'unknown')}`"
            f"{dirty}, {where}, backend {env.get('backend') or DASH}, "
            f"started {env.get('start_time', DASH)}"
        )
    if problems:
        lines += ["", "## Problems reading the records", ""]
        for run_id, items in problems.items():
            lines += [f"- `{run_id}`: {p}" for p in items]
    if unreadable:
        lines += ["", "## Runs left out (cannot be read)", ""]
        for run_id, items in unreadable.items():
            lines += [f"- `{run_id}`: {p}" for p in items]
    return "\n".join(lines) + "\n"


# -- the figures -----------------------------------------------------------------------------
