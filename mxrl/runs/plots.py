"""The figures of `mxrl runs compare` (`mxrl.runs.report`): one function per subject, each taking
the runs as `RunSeries` and returning a matplotlib `Figure` (None without data). Runs of one
recipe (seeds) are drawn as one line, their mean per step, with a band of one standard error of
that mean over the seeds; a single run is a plain line. Steps are integers.

matplotlib is imported here (and for its colour map in `mxrl.runs.report`) only, through `Figure`
(no pyplot, no global backend change): the files are rendered by the Agg canvas, so no display
is needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mxrl.runs.record import SPIKE
from mxrl.runs.summary import TIME_KEYS, RunSummary


@dataclass
class RunSeries:
    """One run as the figures draw it: its label and colour, summary, metric rows and events."""

    label: str
    color: Any
    summary: RunSummary
    rows: list[dict[str, float]]
    events: list[dict[str, Any]]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values of a metric; +-inf become NaN (a gap in the line)."""
        pairs = [(r["step"], r[key]) for r in self.rows if key in r]
        return [p[0] for p in pairs], [v if math.isfinite(v) else math.nan for _, v in pairs]


def _new_figure(num_axes: int):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0 * num_axes, 4.0), layout="constrained")
    axes = fig.subplots(1, num_axes, squeeze=False)[0]
    return fig, list(axes)


def _has(runs: Sequence[RunSeries], key: str) -> bool:
    return any(any(key in r for r in run.rows) for run in runs)


def _log_if_positive(ax, runs: Sequence[RunSeries], key: str) -> None:
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


def _groups(runs: Sequence[RunSeries]) -> list[list[RunSeries]]:
    """Runs of one recipe together (seeds), in first-seen order; runs without one alone."""
    groups: dict[str, list[RunSeries]] = {}
    for run in runs:
        recipe = run.summary.recipe
        groups.setdefault(recipe if recipe else f"id:{run.summary.run_id}", []).append(run)
    return list(groups.values())


def _mean_and_stderr(
    group: Sequence[RunSeries], key: str
) -> tuple[list[int], list[float], list[float]]:
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


def _line_axes(ax, runs: Sequence[RunSeries], key: str, marker: str | None = None) -> None:
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


def _same_series(runs: Sequence[RunSeries], a: str, b: str) -> bool:
    return all(run.series(a) == run.series(b) for run in runs)


def plot_reward(runs: Sequence[RunSeries]):
    keys = [k for k in ("reward/mean", "accuracy") if _has(runs, k)]
    if len(keys) == 2 and _same_series(runs, *keys):
        keys = keys[:1]  # 0/1 rewards: accuracy is the mean reward again
    if not keys:
        return None
    fig, axes = _new_figure(len(keys))
    for ax, key in zip(axes, keys, strict=True):
        _line_axes(ax, runs, key)
    return fig


def plot_heldout(runs: Sequence[RunSeries]):
    """Held-out accuracy per recipe (mean over seeds, band of one standard error)."""
    if not _has(runs, "eval/accuracy"):
        return None
    fig, (ax,) = _new_figure(1)
    _line_axes(ax, runs, "eval/accuracy", marker="o")
    ax.set_title("held-out accuracy, greedy" + (" (band: ± 1 s.e. over seeds)" if any(
        len(g) > 1 for g in _groups(runs)) else ""))  # fmt: skip
    return fig


def plot_mismatch(runs: Sequence[RunSeries]):
    keys = [k for k in ("mismatch/k3", "mismatch/k1") if _has(runs, k)]
    if not keys:
        return None
    fig, axes = _new_figure(len(keys))
    for ax, key in zip(axes, keys, strict=True):
        _line_axes(ax, runs, key)
        _log_if_positive(ax, runs, key)
    fig.suptitle("train-rollout mismatch, KL(rollout || train) estimators")
    return fig


def plot_grad_norm(runs: Sequence[RunSeries]):
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


def plot_step_time(runs: Sequence[RunSeries]):
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


PLOTS = {
    "heldout": plot_heldout,
    "reward": plot_reward,
    "mismatch": plot_mismatch,
    "grad_norm": plot_grad_norm,
    "step_time": plot_step_time,
}
