"""`mxrl demo`'s report (`mxrl.app.demo`): the held-out accuracy per recipe over its seeds (mean
and standard error, whether the final one lies within BF16's band, the mismatch beside it), the
comparison plots and whether every weight sync verified, written to DIR/report.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mxrl.runs import RunRecord, RunSummary, summarize

# "Final" held-out accuracy of a run: the mean of its last 3 evaluations (steps 120, 130, 140).
# One evaluation of 100 problems has a binomial standard error of ~0.05, as large as the
# differences the report looks for; on a still rising curve the mean is the conservative side.
FINAL_EVALS = 3

WARM_SOURCES = {
    "shipped": ", the shipped warm-up: the same start on every machine",
    "cache": ", cached",
    "trained": ", trained here",
}


@dataclass(frozen=True)
class RecipeResult:
    """One recipe over its seeds: held-out accuracy at step 0 (the warm-up policy under the
    recipe) and final (per run the mean of its last FINAL_EVALS evaluations), each a mean over
    seeds, the final one with its standard error over seeds (0 for one seed); mean
    train-rollout mismatch k3 over all steps and seeds."""

    recipe: str
    num_seeds: int
    start: float
    final: float
    final_se: float
    k3: float
    spikes: int
    syncs_ok: int
    syncs: int

    @property
    def gain(self) -> float:
        return self.final - self.start


def recipe_results(runs: list[RunRecord]) -> list[RecipeResult]:
    """The per-recipe numbers of the report, recipes in first-seen order."""
    groups: dict[str, list[RunRecord]] = {}
    for rec in runs:
        groups.setdefault(rec.recipe or rec.run_id, []).append(rec)
    results = []
    for recipe, recs in groups.items():
        starts, finals, k3s = [], [], []
        spikes = syncs_ok = syncs = 0
        for rec in recs:
            evals = [(r["step"], r["eval/accuracy"]) for r in rec.metrics() if "eval/accuracy" in r]
            later = [acc for step, acc in sorted(evals) if step > 0][-FINAL_EVALS:]
            if evals and later:
                starts.append(min(evals)[1])
                finals.append(sum(later) / len(later))
            k3s += [r["mismatch/k3"] for r in rec.metrics() if "mismatch/k3" in r]
            summary = summarize(rec)
            spikes += len(summary.spike_steps)
            syncs_ok, syncs = syncs_ok + summary.num_syncs_ok, syncs + summary.num_syncs
        final, final_se = mean_and_stderr(finals)
        start, k3 = mean_and_stderr(starts)[0], mean_and_stderr(k3s)[0]
        result = RecipeResult(
            recipe, len(recs), start, final, final_se, k3, spikes, syncs_ok, syncs
        )
        results.append(result)
    return results


def mean_and_stderr(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (unbiased std / sqrt(n); 0 for one value)."""
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return math.nan, math.nan
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return mean, 0.0
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return mean, math.sqrt(var / len(xs))


def band_verdict(result: RecipeResult, bf16: RecipeResult | None) -> str:
    """Whether `result`'s final held-out accuracy lies within BF16's band (mean +- 1 standard
    error over seeds, the band the figure draws), with the distance from BF16's mean."""
    if bf16 is None or result.recipe == bf16.recipe:
        return "—"
    diff = result.final - bf16.final
    inside = abs(diff) <= bf16.final_se
    return f"{'yes' if inside else 'no'} ({diff:+.3f})"


def write_report(
    out: Path,
    runs: list[RunRecord],
    comparison,
    warm: dict,
    seconds: float,
    warm_s: float,
    device: str,
    workers: int,
) -> Path:
    results = recipe_results(runs)
    bf16 = next((r for r in results if r.recipe == "bf16"), None)
    num_steps = max((summarize(r).last_step or 0 for r in runs), default=0)
    seeds = max((r.num_seeds for r in results), default=0)
    lines = [
        "# mxrl demo: GRPO on the embedded arithmetic task under each recipe",
        "",
        f"Tiny Qwen3-MoE-style model (4 layers, 8 experts top-2, one shared expert), warmed up by "
        f"{warm['steps']} SFT steps to {warm['accuracy']:.0%} greedy held-out accuracy, then "
        f"{num_steps} steps of synchronous GRPO from the same weights under each recipe, "
        f"{seeds} seed(s) each, on {device}"
        f"{f' ({workers} run(s) at a time, one thread each)' if device == 'cpu' else ''}. "
        f"Total {seconds:.0f} s (warm-up {warm_s:.0f} s"
        f"{WARM_SOURCES.get(warm.get('source', ''), '')}).",
        "",
        _settings_line(runs),
        "",
        "Held-out accuracy: greedy decoding of the 100 problems of the task's held-out split "
        "(never trained on, by SFT or RL), every few steps; step 0 is the warm-up policy under "
        f"the recipe; final is, per run, the mean of its last {FINAL_EVALS} evaluations (one "
        "evaluation's binomial standard error is ~0.05), then the mean over seeds. ± is one "
        "standard error over seeds; BF16's band is its final mean ± one standard error.",
        "",
        "| recipe | seeds | held-out acc., step 0 | held-out acc., final | gain | "
        "within BF16's band | mean mismatch k3 | spikes | syncs verified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.recipe} | {r.num_seeds} | {r.start:.3f} | {r.final:.3f} ± {r.final_se:.3f} | "
            f"{r.gain:+.3f} | {band_verdict(r, bf16)} | {r.k3:.2e} | {r.spikes} | "
            f"{'yes' if r.syncs_ok == r.syncs else 'NO'} ({r.syncs_ok}/{r.syncs}) |"
        )
    lines += [
        "",
        "| run | recipe | held-out acc., step 0 → last step | reward, first 10 steps | "
        "reward, last 10 steps | mean mismatch k3 | spikes | every sync verified |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rec in runs:
        run = run_line(rec, digits=2)
        summary = run.summary
        lines.append(
            f"| {rec.run_id} | {summary.recipe} | {run.held} | {run.reward_first:.3f} | "
            f"{run.reward_last:.3f} | {summary.mean.get('mismatch/k3', math.nan):.2e} | "
            f"{len(summary.spike_steps)} | {'yes' if summary.syncs_verified else 'NO'} "
            f"({summary.num_syncs}) |"
        )
    lines += ["", "## Plots", ""]
    for name, fig in comparison.figures.items():
        lines.append(f"![{name}]({fig.relative_to(out)})")
        lines.append("")
    lines += ["## Side by side", "", comparison.table, ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _settings_line(runs: list[RunRecord]) -> str:
    cfg = runs[0].config if runs else {}
    if "lr" not in cfg:
        return ""
    return (
        f"GRPO: {cfg['prompts_per_step']} prompts x {cfg['samples_per_prompt']} samples per step, "
        f"AdamW lr {cfg['lr']:g} ({cfg.get('lr_schedule', 'constant')}), temperature "
        f"{cfg['temperature']:g}, no KL or entropy term."
    )


@dataclass(frozen=True)
class RunLine:
    """What a report's row for one run reads of its record."""

    summary: RunSummary
    held: str  # held-out accuracy at the first and the last evaluation ("—" without any)
    reward_first: float  # mean reward over the first 10 steps
    reward_last: float  # and over the last 10


def run_line(rec: RunRecord, digits: int) -> RunLine:
    """The run's summary, held-out accuracy first -> last (to `digits` places) and the mean
    reward of its first and last 10 steps."""
    rows = rec.metrics()
    rewards = [row["reward/mean"] for row in rows if "reward/mean" in row]
    evals = [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]
    held = f"{evals[0]:.{digits}f} → {evals[-1]:.{digits}f}" if evals else "—"
    return RunLine(summarize(rec), held, _mean(rewards[:10]), _mean(rewards[-10:]))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
