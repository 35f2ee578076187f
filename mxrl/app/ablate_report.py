"""`mxrl ablate`'s report (mxrl.app.ablate), DIR/report.md beside `compare`'s figures: per recipe
the held-out accuracy (mean ± standard error over seeds), whether it learns (gain >= MIN_GAIN)
and whether it is equivalent to BF16 (final within TOLERANCE of BF16's mean; BF16's band, mean ±
2 standard errors, beside it), the train-rollout mismatch (k3, |Δlogp| mean and max) and its
ordering against the article's, gradient norms and spikes, the rollout / train / sync time per
step, and what to run next when a recipe fails (TIS and MIS on the worst one). docs/ablation.md
explains how to read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mxrl.app.demo_report import (
    FINAL_EVALS,
    RecipeResult,
    mean_and_stderr,
    recipe_results,
    run_line,
)
from mxrl.runs import RunRecord, summarize

# the bars: every recipe gains this much held-out accuracy over the warm-up (mean over
# seeds), and each low-precision recipe ends within TOLERANCE of BF16's final mean
MIN_GAIN = 0.15
TOLERANCE = 0.03
# BF16's band: its final mean ± BAND_SE standard errors over seeds (~95% for a normal mean)
BAND_SE = 2.0
# k3 is compared over the first steps too: the article saw NVFP4 start with a higher KL
EARLY_STEPS = 10


@dataclass(frozen=True)
class RecipeNumbers:
    """One recipe's numbers beyond the demo's `RecipeResult`, over all its steps and seeds."""

    result: RecipeResult
    k3_early: float
    logp_diff_mean: float
    logp_diff_max: float
    grad_norm_mean: float
    grad_norm_max: float
    spike_runs: list[str]
    times: dict[str, float]  # rollout, train, sync: mean seconds per step
    at_once: float = math.nan  # runs running meanwhile, itself included (`runs_at_once`)

    @property
    def recipe(self) -> str:
        return self.result.recipe


def _groups(runs: list[RunRecord]) -> dict[str, list[RunRecord]]:
    groups: dict[str, list[RunRecord]] = {}
    for rec in runs:
        groups.setdefault(rec.recipe or rec.run_id, []).append(rec)
    return groups


def runs_at_once(runs: list[RunRecord]) -> dict[str, float]:
    """Per run, how many of `runs` were running during it on average, itself included (from
    the records' event spans): the load its times were measured under. NaN without a span."""
    spans = {rec.run_id: rec.span() for rec in runs}
    out = {}
    for run_id, (a, b) in ((k, v) for k, v in spans.items() if v is not None and v[1] > v[0]):
        shared = sum(max(0.0, min(b, o[1]) - max(a, o[0])) for o in spans.values() if o)
        out[run_id] = shared / (b - a)
    return {rec.run_id: out.get(rec.run_id, math.nan) for rec in runs}


def recipe_numbers(runs: list[RunRecord]) -> list[RecipeNumbers]:
    results = {r.recipe: r for r in recipe_results(runs)}
    at_once = runs_at_once(runs)
    out = []
    for recipe, recs in _groups(runs).items():
        rows = [row for rec in recs for row in rec.metrics() if "reward/mean" in row]

        def values(key: str, rows=rows) -> list[float]:
            return [float(r[key]) for r in rows if key in r and math.isfinite(float(r[key]))]

        early = [r for r in rows if r["step"] <= EARLY_STEPS]
        spikes = []
        for rec in recs:
            steps = summarize(rec).spike_steps
            if steps:
                spikes.append(f"{rec.run_id}: {', '.join(map(str, steps))}")
        times = {k: _mean(values(f"time/{k}_s")) for k in ("rollout", "train", "sync")}
        number = RecipeNumbers(
            results[recipe], _mean(values("mismatch/k3", early)),
            _mean(values("mismatch/logp_abs_diff_mean")),
            max(values("mismatch/logp_abs_diff_max"), default=math.nan),
            _mean(values("grad/norm")), max(values("grad/norm"), default=math.nan),
            spikes, times, _mean([at_once[rec.run_id] for rec in recs]),
        )  # fmt: skip
        out.append(number)
    return out


def equivalence(r: RecipeResult, bf16: RecipeResult | None) -> tuple[str, str]:
    """(within TOLERANCE of BF16's final mean, inside BF16's band of ± BAND_SE s.e.)."""
    if bf16 is None or r.recipe == bf16.recipe:
        return "—", "—"
    diff = r.final - bf16.final
    within = f"{'yes' if abs(diff) <= TOLERANCE else 'NO'} ({diff:+.3f})"
    band = "yes" if abs(diff) <= BAND_SE * bf16.final_se else "no"
    return within, band


def mismatch_ordering(numbers: list[RecipeNumbers]) -> list[str]:
    """The article's ordering, checked: BF16 has the smallest mismatch (k3, whole run), and NVFP4
    starts higher than MXFP8 (k3 over the first EARLY_STEPS steps)."""
    by = {n.recipe: n for n in numbers}
    lines = []
    ranked = sorted(numbers, key=lambda n: n.result.k3)
    lines.append("k3 over the run, smallest first: " + " < ".join(
        f"{n.recipe} {n.result.k3:.2e}" for n in ranked))  # fmt: skip
    if "bf16" in by and len(numbers) > 1:
        lowest = ranked[0].recipe == "bf16"
        lines.append(f"BF16 lowest (the article: every low-precision run has a larger mismatch): "
                     f"{'yes' if lowest else 'NO'}")  # fmt: skip
    nv = [n.k3_early for n in numbers if n.recipe.startswith("nvfp4")]
    mx = [n.k3_early for n in numbers if n.recipe.startswith("mxfp8")]
    if nv and mx:
        holds = min(nv) > max(mx)
        lines.append(
            f"NVFP4 starts higher than MXFP8 (k3, steps 1-{EARLY_STEPS}; the article: NVFP4 began "
            f"with a higher KL): {'yes' if holds else 'NO'} (NVFP4 {min(nv):.2e}-{max(nv):.2e}, "
            f"MXFP8 {min(mx):.2e}-{max(mx):.2e})"
        )
    return lines


def write_ablation_report(
    out: Path,
    runs: list[RunRecord],
    comparison: Any,
    config: dict,
    warm: dict,
    settings: Any,
    times: dict[str, float],
    workers: int,
) -> Path:
    numbers = recipe_numbers(runs)
    bf16 = next((n.result for n in numbers if n.recipe == "bf16"), None)
    lines = _header(out, runs, config, warm, settings, times, workers)
    lines += _accuracy_section(numbers, bf16, out)
    lines += _mismatch_section(numbers)
    lines += _gradient_section(numbers)
    lines += _time_section(numbers)
    lines += _runs_section(runs)
    lines += ["## Figures", ""]
    figures = dict(comparison.figures)
    logp = plot_logp_diff(runs, out / "logp_diff.png")
    if logp is not None:
        figures["logp_diff"] = logp
    for name, fig in figures.items():
        lines += [f"![{name}]({fig.relative_to(out)})", ""]
    lines += ["## Side by side", "", comparison.table, ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _header(out, runs, config, warm, settings, times, workers) -> list[str]:
    cfg = runs[-1].config if runs else {}  # this invocation's (a baseline's runs come first)
    seeds = max((len(g) for g in _groups(runs).values()), default=0)
    correction = cfg.get("correction") or "none"
    borrowed = [r for r in runs if out.resolve() not in r.path.resolve().parents]
    lines = [
        "# mxrl ablate: GRPO under the article's recipes",
        "",
        f"Model `{settings.model}` ({num_params(config) / 1e6:.1f}M parameters), the multi-step "
        f"arithmetic task (operands 0-{settings.max_operand}, {settings.eval_size} held-out "
        f"problems), warmed up by {warm['steps']} SFT steps to {warm['dev_accuracy']:.0%} greedy "
        f"accuracy on the dev split ({warm['source']}), then {settings.steps} steps of "
        f"synchronous GRPO from the same weights under each recipe, {seeds} seed(s) each, on "
        f"{settings.device}{f' ({workers} run(s) at a time)' if workers else ''}. Rollout "
        f"correction: {correction}.",
        "",
    ]
    if borrowed:
        folders = sorted({str(r.path.parent.parent) for r in borrowed})
        lines += [f"BF16 baseline: {len(borrowed)} run(s) of an earlier ablation "
                  f"({', '.join(folders)}), without this call's correction.", ""]  # fmt: skip
    return [
        *lines,
        f"GRPO: {settings.prompts_per_step} prompts x {settings.samples_per_prompt} samples per "
        f"step, AdamW lr {settings.lr:g} ({cfg.get('lr_schedule', 'constant')}), temperature "
        f"{cfg.get('temperature', 1.0):g}, no KL or entropy term.",
        "",
        f"Time: {times['total']:.0f} s in all (warm-up {times['warmup']:.0f} s, runs "
        f"{times['runs']:.0f} s, the rest setup and this report)."
        if times
        else "Time: not measured (this report was rewritten from the run records).",
        "",
    ]


def num_params(config: dict) -> int:
    """The model's parameter count, from its config.json (every tensor the family lists)."""
    from mxrl.arch import tensors_from_hf_config

    return sum(math.prod(shape) for _, shape in tensors_from_hf_config(config))


def _accuracy_section(
    numbers: list[RecipeNumbers], bf16: RecipeResult | None, out: Path
) -> list[str]:
    lines = [
        "## Held-out accuracy",
        "",
        f"Greedy decoding of the held-out problems (never trained on). Step 0 is the warm-up "
        f"policy under the recipe; final is, per run, the mean of its last {FINAL_EVALS} "
        f"evaluations, then the mean over seeds ± one standard error. Learns: gain >= "
        f"{MIN_GAIN}. Equivalent: final within {TOLERANCE} of BF16's mean. BF16's band: its mean "
        f"± {BAND_SE:g} standard errors"
        + (f" = {bf16.final:.3f} ± {BAND_SE * bf16.final_se:.3f}." if bf16 else "."),
        "",
        "| recipe | seeds | step 0 | final | gain | learns | within 0.03 of BF16 | "
        "inside BF16's band | syncs verified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    failing: list[RecipeNumbers] = []
    for n in numbers:
        r = n.result
        within, band = equivalence(r, bf16)
        learns = r.gain >= MIN_GAIN
        if not learns or within.startswith("NO"):
            failing.append(n)
        lines.append(
            f"| {r.recipe} | {r.num_seeds} | {r.start:.3f} | {r.final:.3f} ± {r.final_se:.3f} | "
            f"{r.gain:+.3f} | {'yes' if learns else 'NO'} | {within} | {band} | "
            f"{'yes' if r.syncs_ok == r.syncs else 'NO'} ({r.syncs_ok}/{r.syncs}) |"
        )
    lines += ["", *_verdict(failing, bf16, out), ""]
    return lines


def _verdict(failing: list[RecipeNumbers], bf16: RecipeResult | None, out: Path) -> list[str]:
    if not failing:
        return [f"**Every recipe learns (gain >= {MIN_GAIN}) and every low-precision recipe "
                f"ends within {TOLERANCE} of BF16.**"]  # fmt: skip
    names = ", ".join(r.recipe for r in failing)
    low = [n.result for n in failing if bf16 is None or n.recipe != bf16.recipe]
    if not low:
        return [
            f"**Not met by: {names}.** BF16 itself gains less than {MIN_GAIN}: the settings "
            "(warm-up, steps, learning rate) leave RL too little, whatever the format."
        ]
    ref = bf16.final if bf16 is not None else math.nan
    # the worst off: the lowest final held-out accuracy (then the smallest gain); a recipe
    # that ends above BF16's band fails the equivalence but is no candidate for a correction
    worst = min(low, key=lambda r: (r.final, r.gain))
    why = []
    for n in failing:
        r = n.result
        k3 = f"{r.k3 / bf16.k3:.1f}x BF16's" if bf16 and bf16.k3 > 0 else f"{r.k3:.2e}"
        why.append(f"- {r.recipe}: gain {r.gain:+.3f}, final {r.final - ref:+.3f} from BF16; "
                   f"mismatch k3 {k3}, |Δlogp| max {n.logp_diff_max:.2f}; {r.spikes} "
                   f"gradient spike(s), largest norm {n.grad_norm_max:.3g}")  # fmt: skip
    short = (
        [f"BF16 itself gains less than {MIN_GAIN}: the settings (warm-up, steps, learning rate, "
         "model, task) leave RL too little, whatever the format; the recipes are compared with "
         "BF16 above, not with the bar.", ""]
        if bf16 is not None and bf16.gain < MIN_GAIN
        else []
    )  # fmt: skip
    return [
        f"**Not met by: {names}.** What comes with the gap (the sections below have the rest):",
        "",
        *why,
        "",
        *short,
        f"The worst is {worst.recipe}; run it with TIS and with MIS against these BF16 runs "
        "(docs/ablation.md):",
        "",
        *(
            f"    mxrl ablate --recipes {worst.recipe} --correction {c} --baseline {out} "
            f"--out {out}-{c}"
            for c in ("tis", "mis")
        ),
    ]


def _mismatch_section(numbers: list[RecipeNumbers]) -> list[str]:
    lines = [
        "## Train-rollout mismatch",
        "",
        "Per step, on the sampled tokens: k3 estimate of KL(rollout || train) and |Δlogp| = "
        "|log p_train - log p_rollout| (its mean over tokens, and its largest token); here the "
        "means over steps and seeds, and the largest over the whole recipe.",
        "",
        f"| recipe | k3, mean | k3, steps 1-{EARLY_STEPS} | \\|Δlogp\\| mean | \\|Δlogp\\| max |",
        "|---|---|---|---|---|",
    ]
    for n in numbers:
        lines.append(f"| {n.recipe} | {n.result.k3:.2e} | {n.k3_early:.2e} | "
                     f"{n.logp_diff_mean:.2e} | {n.logp_diff_max:.2e} |")  # fmt: skip
    return [*lines, "", *(f"- {line}" for line in mismatch_ordering(numbers)), ""]


def _gradient_section(numbers: list[RecipeNumbers]) -> list[str]:
    lines = [
        "## Gradient norms and spikes",
        "",
        "Gradient norm before clipping; a spike is the trainer's detector's (mxrl/rl/stability.py: "
        "robust z-score of log(norm) over the last steps above its threshold, after 10 steps of "
        "history). The article saw occasional NVFP4 spikes.",
        "",
        "| recipe | grad norm, mean | grad norm, max | spikes | where (run: steps) |",
        "|---|---|---|---|---|",
    ]
    for n in numbers:
        where = "; ".join(n.spike_runs) or "—"
        lines.append(f"| {n.recipe} | {n.grad_norm_mean:.3f} | {n.grad_norm_max:.3f} | "
                     f"{n.result.spikes} | {where} |")  # fmt: skip
    return [*lines, ""]


def _time_section(numbers: list[RecipeNumbers]) -> list[str]:
    lines = [
        "## Time per step",
        "",
        "Mean seconds per GRPO step, every run of the recipe; the runs shared one device, so "
        "these are times under that load: runs at once is how many of the runs were running "
        "during the recipe's runs, on average, themselves included (from their event times). "
        "Compare times between recipes whose loads are close.",
        "",
        "| recipe | rollout | train | sync | step | runs at once |",
        "|---|---|---|---|---|---|",
    ]
    for n in numbers:
        t, load = n.times, "—" if math.isnan(n.at_once) else f"{n.at_once:.1f}"
        lines.append(f"| {n.recipe} | {t['rollout']:.3f} | {t['train']:.3f} | {t['sync']:.3f} | "
                     f"{sum(t.values()):.3f} | {load} |")  # fmt: skip
    return [*lines, ""]


def _runs_section(runs: list[RunRecord]) -> list[str]:
    lines = [
        "## Runs",
        "",
        "| run | held-out, step 0 → last | reward, first 10 steps | reward, last 10 steps | "
        "spikes | every sync verified |",
        "|---|---|---|---|---|---|",
    ]
    for rec in runs:
        run = run_line(rec, digits=3)
        lines.append(
            f"| {rec.run_id} | {run.held} | {run.reward_first:.3f} | {run.reward_last:.3f} | "
            f"{len(run.summary.spike_steps)} | {'yes' if run.summary.syncs_verified else 'NO'} |"
        )
    return [*lines, ""]


def plot_logp_diff(runs: list[RunRecord], path: Path) -> Path | None:
    """|Δlogp| per step (mean over tokens, and the largest token), per recipe the mean over its
    seeds: the mismatch beside `compare`'s k1 and k3 figure."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    keys = ("mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_max")
    fig = Figure(figsize=(12.0, 4.0), layout="constrained")
    axes = fig.subplots(1, 2)
    drawn = False
    for i, (recipe, recs) in enumerate(_groups(runs).items()):
        for ax, key in zip(axes, keys, strict=True):
            per_step: dict[int, list[float]] = {}
            for rec in recs:
                for row in rec.metrics():
                    if key in row and math.isfinite(float(row[key])):
                        per_step.setdefault(row["step"], []).append(float(row[key]))
            if per_step:
                steps = sorted(per_step)
                means = [_mean(per_step[s]) for s in steps]
                ax.plot(steps, means, color=colormaps["tab10"](i % 10), label=recipe, linewidth=1.2)
                drawn = True
    if not drawn:
        return None
    for ax, key in zip(axes, keys, strict=True):
        ax.set_title(key + " (mean over seeds)")
        ax.set_xlabel("GRPO step")
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def _mean(xs: list[float]) -> float:
    return mean_and_stderr(xs)[0] if xs else math.nan
