"""`mxrl demo`: the article's ablation in miniature, on the embedded task, on a laptop CPU.

Warm-up (cached SFT on the arithmetic task, to partial accuracy), then synchronous GRPO from the
same warmed model under each recipe (bf16, mxfp8, nvfp4-dequantized; `--all`: the six article
presets) and seed, every run recorded under DIR/runs/, then DIR/report.md with the comparison
plots (reward, mismatch KL, gradient norm with spikes, time breakdown) and whether every weight
sync verified.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from mxrl.kernels import select_backend
from mxrl.recipe import builtin_config, resolve
from mxrl.rl.loop import GRPOConfig, GRPOTrainer
from mxrl.rl.sources import TaskSource
from mxrl.rl.task import ArithmeticTask
from mxrl.rl.warmup import warmed_up_model
from mxrl.runs import RunRecord, compare, summarize

logger = logging.getLogger(__name__)

DEMO_RECIPES = ("bf16", "mxfp8", "nvfp4-dequantized")
ARTICLE_RECIPES = ("bf16", "mxfp8", "mxfp8-hp", "mxfp8-dequantized", "nvfp4-hp",
                   "nvfp4-dequantized")  # fmt: skip
WARMUP_STEPS = 300


def demo_config(device: str) -> GRPOConfig:
    """The demo's RL settings: 32 prompts x 8 samples per step, 60 steps, lr 3e-4."""
    task = ArithmeticTask(seed=1)
    return GRPOConfig(
        steps=60, prompts_per_step=32, samples_per_prompt=8, lr=3e-4,
        max_new_tokens=task.max_new_tokens, device=device, seed=0,
    )  # fmt: skip


def run_demo(
    out: str | Path,
    *,
    recipes: tuple[str, ...] = DEMO_RECIPES,
    seeds: int = 1,
    steps: int | None = None,
    device: str | None = None,
) -> Path:
    """Run the demo into `out`; returns the path of report.md."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    cfg_model = builtin_config("tiny-moe")
    base, warm = warmed_up_model(cfg_model, ArithmeticTask(seed=0), WARMUP_STEPS)
    logger.info("warm-up accuracy %.2f (%.0f s)", warm["accuracy"], time.perf_counter() - t0)
    runs = []
    for recipe in recipes:
        for seed in range(seeds):
            cfg = replace(demo_config(device), recipe=recipe, seed=seed)
            if steps is not None:
                cfg = replace(cfg, steps=steps)
            model = copy.deepcopy(base).to(device)
            plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
            record = RunRecord.create(
                out / "runs", f"{recipe}-seed{seed}-{time.strftime('%Y%m%dT%H%M%S')}",
                config={**asdict(cfg), "warmup": warm}, plan_json=plan,
                backend=str(select_backend(cfg.backend, device)),
            )  # fmt: skip
            with record.guard(lambda: 0):  # a failure before step 1 is recorded too
                source = TaskSource(ArithmeticTask(seed=1 + seed))
                trainer = GRPOTrainer(cfg, model, source, record)
            logger.info("demo: %s seed %d (%d steps)", recipe, seed, cfg.steps)
            trainer.run()
            runs.append(record)
    report = compare(runs, out)
    path = _write_report(out, runs, report, warm, time.perf_counter() - t0)
    logger.info("demo: report at %s (%.0f s)", path, time.perf_counter() - t0)
    return path


def _write_report(out: Path, runs: list[RunRecord], comparison, warm: dict, seconds: float) -> Path:
    lines = [
        "# mxrl demo: GRPO on the embedded arithmetic task under each recipe",
        "",
        f"Tiny Qwen3-MoE-style model (4 layers, 8 experts top-2, one shared expert), warmed up by "
        f"{warm['steps']} SFT steps to {warm['accuracy']:.0%} greedy accuracy, then synchronous "
        f"GRPO from the same weights under each recipe. Total {seconds:.0f} s.",
        "",
        "| run | recipe | reward, first 10 steps | reward, last 10 steps | rose | "
        "mean mismatch k3 | spikes | every sync verified |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rec in runs:
        summary = summarize(rec)
        rewards = [row["reward/mean"] for row in rec.metrics()]
        first, last = _mean(rewards[:10]), _mean(rewards[-10:])
        lines.append(
            f"| {rec.run_id} | {summary.recipe} | {first:.3f} | {last:.3f} | "
            f"{'yes' if last > first else 'no'} | {summary.mean.get('mismatch/k3', float('nan')):.2e} | "
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


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
