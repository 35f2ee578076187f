"""Compare runs: PNG plots (one figure per subject, one series per run) and comparison.md.

    result = compare(["runs/bf16-a", "runs/nvfp4-b"], "reports/ablation")
    result.figures  # {"reward": Path(".../reward.png"), ...}; a figure without data is skipped

Figures: heldout (eval/accuracy: greedy accuracy on a held-out set, logged every few steps),
reward (reward/mean; accuracy too where it is not the same numbers), mismatch
(mismatch/k3, mismatch/k1; log scale when every value is positive), grad_norm (grad/norm, spikes
marked from the grad/spike metric and spike events), step_time (mean time/rollout_s,
time/train_s, time/sync_s per run, stacked). Series are labelled by config recipe, else by run
id. Runs of one recipe (seeds) are drawn as one line, their mean per step, with a band of one
standard error of that mean over the seeds; a single run is a plain line. Steps are integers.

matplotlib is imported here only, through `Figure` (no pyplot, no global backend change): the
files are rendered by the Agg canvas, so no display is needed.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxrl.runs import health
from mxrl.runs.env import utc_now
from mxrl.runs.record import SPIKE, RunRecord
from mxrl.runs.summary import DASH, TIME_KEYS, RunSummary, fmt, spikes_line, summarize, syncs_line

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


@dataclass
class _Run:
    label: str
    color: Any
    summary: RunSummary
    rows: list[dict[str, float]]
    events: list[dict[str, Any]]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values of a metric; +-inf become NaN (a gap in the line)."""
        pairs = [(r["step"], r[key]) for r in self.rows if key in r]
        return [p[0] for p in pairs], [v if math.isfinite(v) else math.nan for _, v in pairs]


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
        _Run(label, palette(i % 10), summarize(rec), rec.metrics(), rec.events())
        for i, (rec, label) in enumerate(zip(records, _labels(records), strict=True))
    ]
    figures: dict[str, Path] = {}
    skipped = []
    for name, plot in _PLOTS.items():
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
    runs: Sequence[_Run],
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


def _new_figure(num_axes: int):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0 * num_axes, 4.0), layout="constrained")
    axes = fig.subplots(1, num_axes, squeeze=False)[0]
    return fig, list(axes)


def _has(runs: Sequence[_Run], key: str) -> bool:
    return any(any(key in r for r in run.rows) for run in runs)


def _log_if_positive(ax, runs: Sequence[_Run], key: str) -> None:
    values = [v for run in runs for v in run.series(key)[1] if not math.isnan(v)]
    if values and min(values) > 0:
        ax.set_yscale("log")


# y-axis label of each plotted metric
_YLABELS = {
    "eval/accuracy": "held-out accuracy (greedy)",
    "reward/mean": "mean reward per step",
    "accuracy": "accuracy (share of rewards > 0.5)",
    "mismatch/k3": "k3 estimate of KL(rollout || train)",
    "mismatch/k1": "k1 estimate of KL(rollout || train)",
    "grad/norm": "gradient norm (before clipping)",
}


def _groups(runs: Sequence[_Run]) -> list[list[_Run]]:
    """Runs of one recipe together (seeds), in first-seen order; runs without one alone."""
    groups: dict[str, list[_Run]] = {}
    for run in runs:
        recipe = run.summary.recipe
        groups.setdefault(recipe if recipe else f"id:{run.summary.run_id}", []).append(run)
    return list(groups.values())


def _mean_and_stderr(group: Sequence[_Run], key: str) -> tuple[list[int], list[float], list[float]]:
    """Per step logged by every run of the group: the mean and its standard error over runs
    (0 for a single run)."""
    per_run = [dict(zip(*run.series(key), strict=True)) for run in group]
    steps = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
    means, errors = [], []
    for step in steps:
        values = [d[step] for d in per_run if not math.isnan(d[step])]
        n = len(values)
        mean = sum(values) / n if n else math.nan
        var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
        means.append(mean)
        errors.append(math.sqrt(var / n) if n > 1 else 0.0)
    return steps, means, errors


def _line_axes(ax, runs: Sequence[_Run], key: str, marker: str | None = None) -> None:
    from matplotlib.ticker import MaxNLocator

    seeded = 0
    for group in _groups(runs):
        steps, means, errors = _mean_and_stderr(group, key)
        if not steps:
            continue
        first = group[0]
        label = first.summary.recipe or first.label
        if len(group) > 1:
            seeded = max(seeded, len(group))
            label = f"{label} (mean of {len(group)} seeds)"
            ax.fill_between(
                steps,
                [m - e for m, e in zip(means, errors, strict=True)],
                [m + e for m, e in zip(means, errors, strict=True)],
                color=first.color,
                alpha=0.2,
                linewidth=0,
            )
        ax.plot(steps, means, color=first.color, label=label, linewidth=1.4, marker=marker,
                markersize=3)  # fmt: skip
    ax.set_title(key + (" (band: ± 1 standard error over seeds)" if seeded else ""))
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(_YLABELS.get(key, key))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def _same_series(runs: Sequence[_Run], a: str, b: str) -> bool:
    return all(run.series(a) == run.series(b) for run in runs)


def plot_reward(runs: Sequence[_Run]):
    keys = [k for k in ("reward/mean", "accuracy") if _has(runs, k)]
    if len(keys) == 2 and _same_series(runs, *keys):
        keys = keys[:1]  # 0/1 rewards: accuracy is the mean reward again
    if not keys:
        return None
    fig, axes = _new_figure(len(keys))
    for ax, key in zip(axes, keys, strict=True):
        _line_axes(ax, runs, key)
    return fig


def plot_heldout(runs: Sequence[_Run]):
    """Held-out accuracy per recipe (mean over seeds, band of one standard error)."""
    if not _has(runs, "eval/accuracy"):
        return None
    fig, (ax,) = _new_figure(1)
    _line_axes(ax, runs, "eval/accuracy", marker="o")
    ax.set_title("held-out accuracy, greedy" + (" (band: ± 1 s.e. over seeds)" if any(
        len(g) > 1 for g in _groups(runs)) else ""))  # fmt: skip
    return fig


def plot_mismatch(runs: Sequence[_Run]):
    keys = [k for k in ("mismatch/k3", "mismatch/k1") if _has(runs, k)]
    if not keys:
        return None
    fig, axes = _new_figure(len(keys))
    for ax, key in zip(axes, keys, strict=True):
        _line_axes(ax, runs, key)
        _log_if_positive(ax, runs, key)
    fig.suptitle("train-rollout mismatch, KL(rollout || train) estimators")
    return fig


def plot_grad_norm(runs: Sequence[_Run]):
    if not _has(runs, "grad/norm"):
        return None
    fig, (ax,) = _new_figure(1)
    _line_axes(ax, runs, "grad/norm")
    marked = False
    for run in runs:
        norm = {r["step"]: r["grad/norm"] for r in run.rows if "grad/norm" in r}
        from_events = {
            e["step"]: e.get("grad_norm")
            for e in run.events
            if e.get("type") == SPIKE and isinstance(e.get("step"), int)
        }
        xs, ys = [], []
        for step in run.summary.spike_steps:
            y = norm.get(step, from_events.get(step))
            try:
                y = float(y)
            except (TypeError, ValueError):
                continue
            if math.isfinite(y):
                xs.append(step)
                ys.append(y)
        if xs:
            ax.scatter(
                xs,
                ys,
                marker="o",
                s=60,
                facecolors="none",
                edgecolors=run.color,
                linewidths=1.8,
                zorder=3,
            )
            marked = True
    _log_if_positive(ax, runs, "grad/norm")
    ax.set_title("grad/norm" + (" (circles: spikes)" if marked else ""))
    return fig


def plot_step_time(runs: Sequence[_Run]):
    if not any(_has(runs, k) for k in TIME_KEYS):
        return None
    fig, (ax,) = _new_figure(1)
    labels = [run.label for run in runs]
    bottoms = [0.0] * len(runs)
    hatches = ("", "//", "..")
    for key, hatch in zip(TIME_KEYS, hatches, strict=True):
        means = []
        for run in runs:
            v = run.summary.mean.get(key, 0.0)
            means.append(v if math.isfinite(v) else 0.0)
        ax.bar(
            range(len(runs)),
            means,
            bottom=bottoms,
            label=key.removeprefix("time/"),
            color=[run.color for run in runs],
            hatch=hatch,
            edgecolor="black",
            linewidth=0.6,
        )
        bottoms = [b + m for b, m in zip(bottoms, means, strict=True)]
    ax.set_xticks(range(len(runs)), labels, rotation=15 if len(runs) > 3 else 0, fontsize="small")
    ax.set_ylabel("seconds per step (mean)")
    ax.set_title("step time: rollout (plain) / train (//) / sync (..)")
    ax.grid(True, axis="y", alpha=0.3)
    from matplotlib.patches import Patch

    parts = [
        Patch(facecolor="white", edgecolor="black", hatch=h, label=k.removeprefix("time/"))
        for k, h in zip(TIME_KEYS, hatches, strict=True)
    ]
    ax.legend(handles=parts, fontsize="small")
    return fig


_PLOTS = {
    "heldout": plot_heldout,
    "reward": plot_reward,
    "mismatch": plot_mismatch,
    "grad_norm": plot_grad_norm,
    "step_time": plot_step_time,
}
