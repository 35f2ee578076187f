"""`mxrl demo`: the article's ablation in miniature, on the embedded task, on a laptop CPU.

Warm-up (cached SFT on the arithmetic task, to partial accuracy), then synchronous GRPO from the
same warmed model under each recipe (bf16, mxfp8, nvfp4-dequantized; `--all`: the six article
presets) and seed (3 by default), on the CPU as many runs at once as there are cores (one
process and one thread each), every run recorded under DIR/runs/, then DIR/report.md: the
held-out accuracy per recipe (mean and standard error over seeds, whether the final one lies
within BF16's band, the train-rollout mismatch k3 beside it), the comparison plots and whether
every weight sync verified. docs/rl.md ("The demo") has the settings and the ablation behind
them.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from mxrl.app.demo_report import write_report
from mxrl.app.progress import Progress, ReportingRecord, message, run_in_workers
from mxrl.app.sources import TaskSource
from mxrl.app.task import ArithmeticTask
from mxrl.app.warmup import warmed_up_model
from mxrl.arch import ModelConfig, builtin_config
from mxrl.models import CausalLM, build_model, empty_model
from mxrl.rl.config import GRPOConfig, plain
from mxrl.rl.resolve import resolve_train
from mxrl.rl.trainer import GRPOTrainer
from mxrl.runs import RunRecord, compare
from mxrl.runs.tensorboard import attach_tensorboard, require_tensorboard

logger = logging.getLogger(__name__)

DEMO_RECIPES = ("bf16", "mxfp8", "nvfp4-dequantized")
ARTICLE_RECIPES = ("bf16", "mxfp8", "mxfp8-hp", "mxfp8-dequantized", "nvfp4-hp",
                   "nvfp4-dequantized")  # fmt: skip
DEMO_SEEDS = 3
# SFT steps before RL: 600 leave the policy at ~0.35 held-out accuracy and ~0.55 reward on the
# train split, where most groups of 4 mix right and wrong answers (docs/rl.md, "The demo").
WARMUP_STEPS = 600
# One train/eval split (split_seed 0) for the warm-up and every RL seed: the 100 held-out
# problems are never trained on, by SFT or by RL. 20+20 and 20-20 at most: 882 problems,
# a quarter of them held out.
DEMO_TASK = dict(max_operand=20, ops="+-", eval_fraction=0.25, eval_size=100, split_seed=0)
EVAL_EVERY = 10
# The learning rate: constant for the first half of the run, then linear down to this fraction
# of it at the last step. At a constant 5e-4 the greedy policy moves by +-0.05 held-out accuracy
# between evaluations and plateaus near 0.6; the decay lets it settle higher (docs/rl.md).
LR_FINAL_FRACTION = 0.2
LR_SCHEDULE = f"constant for the first half, then linear to {LR_FINAL_FRACTION} x lr at the end"
# The engine's KV cache: 1024 blocks of 16 tokens, for the 128 sequences of a step (one block
# each) instead of the engine's default (1 GiB on the CPU, half the free memory on a GPU, which
# runs trained side by side on one GPU would split), zero-filled once per run.
KV_CACHE_BYTES = 16 << 20
# A run's time relative to bf16's on the CPU (measured: the low-precision recipes emulate their
# formats), to start the slowest runs first when several train at once.
RECIPE_COST = {"bf16": 1.0, "mxfp8": 2.3, "mxfp8-hp": 2.3, "mxfp8-dequantized": 2.3,
               "nvfp4-hp": 1.8, "nvfp4-dequantized": 1.8}  # fmt: skip
# A progress line per run every this many steps (and at its last): at 0.3-0.5 s a step, one
# every 6-10 s per run, its held-out accuracy as fresh as the evaluations (every EVAL_EVERY).
PROGRESS_EVERY = 20
# Where a run sends each metrics row (`progress.message`): the parent's `Progress.update` when
# the runs train in this process, a worker's queue to the parent otherwise (`_init_worker`).
_progress_sink: Callable[..., None] | None = None


def demo_task(seed: int) -> ArithmeticTask:
    """The task of RL seed `seed` (the warm-up's is seed -1): its own stream of train
    problems, the shared split and held-out set."""
    return ArithmeticTask(seed=seed + 1, **DEMO_TASK)


@dataclass(frozen=True)
class RunSetup:
    """What a run of the demo and a run of `mxrl ablate` (mxrl.app.ablate) set apart: the model
    config, the task of each RL seed (a module-level function: a worker process unpickles it),
    the task's settings and the learning-rate schedule as the record states them, the engine's
    KV cache and the word the log lines start with. The defaults are the demo's."""

    model: dict = field(default_factory=lambda: builtin_config("tiny-moe"))
    task: Callable[[int], object] = demo_task
    task_settings: dict = field(default_factory=lambda: dict(DEMO_TASK))
    lr_schedule: str = LR_SCHEDULE
    kv_cache_bytes: int = KV_CACHE_BYTES
    name: str = "demo"
    model_name: str = "tiny-moe"  # the run config's `model` (a report rewritten from it reads it)


def demo_config(device: str) -> GRPOConfig:
    """The demo's RL settings: 32 prompts x 4 samples per step, 140 steps, lr 5e-4 (decayed over
    the second half: `lr_factor`), held-out accuracy every 10 steps, the engine's GEMMs over
    tiles of 128 rows (a decode step's 128 sequences in one GEMM; with 32, the CPU default, a
    rollout took 1.1x (bf16) to 1.6x (mxfp8) as long). docs/rl.md, "The demo": why these."""
    return GRPOConfig(
        steps=140, prompts_per_step=32, samples_per_prompt=4, lr=5e-4,
        max_new_tokens=demo_task(0).max_new_tokens, device=device, seed=0,
        eval_every=EVAL_EVERY, engine_tile=128,
    )  # fmt: skip


def lr_factor(step: int, steps: int) -> float:
    """The learning rate of GRPO step `step` (1-based) of `steps`, as a fraction of the peak: 1
    for the first half, then linear down to LR_FINAL_FRACTION at the last step."""
    hold = steps // 2
    if step <= hold:
        return 1.0
    return 1.0 - (1.0 - LR_FINAL_FRACTION) * (step - hold) / (steps - hold)


def run_demo(
    out: str | Path,
    *,
    recipes: tuple[str, ...] = DEMO_RECIPES,
    seeds: int = DEMO_SEEDS,
    steps: int | None = None,
    device: str | None = None,
    workers: int | None = None,
    local_warmup: bool = False,
    tensorboard: bool = False,
) -> Path:
    """Run the demo into `out`; returns the path of report.md. `workers`: runs trained at once,
    each in a process of its own with one intra-op thread (default: one per CPU core this
    process may use; on a GPU the runs share it, the tiny model leaving it mostly idle).
    local_warmup: train the SFT warm-up on this machine (cached) instead of loading the shipped
    one (mxrl.app.warmup: the warm-up's end point depends on the processor). tensorboard: each
    run also writes TensorBoard files under its folder (mxrl.runs.tensorboard)."""
    if tensorboard:
        require_tensorboard("tensorboard")  # before anything is written
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if workers is None:
        workers = usable_cpus()
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    threads = torch.get_num_threads()
    # The demo's tensors are tiny: a second intra-op thread gains little, and when another
    # process holds a core, OpenMP threads waiting on each other made steps 10x slower. The
    # cores go to runs trained side by side instead (`workers`). One thread on a GPU host too:
    # the warm-up (on the CPU) then sums in the same order as on a CPU-only machine (with 16
    # threads an H200 host's warm-up reached 0.53 held-out accuracy instead of 0.36).
    torch.set_num_threads(1)
    try:
        return _run_demo(out, recipes, seeds, steps, device, workers, local_warmup, tensorboard)
    finally:
        torch.set_num_threads(threads)


def _run_demo(
    out: Path,
    recipes: tuple[str, ...],
    seeds: int,
    steps: int | None,
    device: str,
    workers: int,
    local_warmup: bool,
    tensorboard: bool,
) -> Path:
    t0 = time.perf_counter()
    base, warm = warmed_up_model(
        builtin_config("tiny-moe"), demo_task(-1), WARMUP_STEPS, shipped=not local_warmup
    )
    warm_s = time.perf_counter() - t0
    logger.info("warm-up held-out accuracy %.2f (%.0f s)", warm["accuracy"], warm_s)
    jobs = [(recipe, seed) for recipe in recipes for seed in range(seeds)]
    configs = {}
    for recipe, seed in jobs:
        cfg = replace(demo_config(device), recipe=recipe, seed=seed)
        configs[recipe, seed] = cfg if steps is None else replace(cfg, steps=steps)
    workers = min(workers, len(jobs))
    progress = Progress(
        steps={job: configs[job].steps for job in jobs},
        cost={job: RECIPE_COST.get(job[0], 1.0) for job in jobs},
        every=PROGRESS_EVERY,
    )
    if workers == 1:
        paths = train_here(base, configs, jobs, (out, warm, tensorboard), progress)
    else:
        paths = train_in_workers(base, configs, jobs, (out, warm, tensorboard), progress, workers)
    runs = [RunRecord.open(path) for path in paths]
    report = compare(runs, out)
    seconds = time.perf_counter() - t0
    path = write_report(out, runs, report, warm, seconds, warm_s, device, workers)
    logger.info("demo: report at %s (%.0f s)", path, seconds)
    return path


def train_here(base, configs, jobs, common, progress: Progress) -> list[Path]:
    """Every run in this process, one after the other, each step reported to `progress`.
    common: `_train_run`'s last arguments (out, warm, tensorboard[, setup])."""
    global _progress_sink
    _progress_sink = progress.update
    try:
        return [_train_run(base, configs[job], *common) for job in jobs]
    finally:
        _progress_sink = None


def train_in_workers(base, configs, jobs, common, progress: Progress, workers) -> list[Path]:
    """Each run in a worker process of its own (`workers` at a time), the slowest recipes
    first, so the last runs to finish are short ones; their steps become progress lines.
    base: the warmed model (its state dict goes to each worker) or the path of its
    safetensors file (each worker reads it: a large model is not pickled once per run)."""
    name = common[3].name if len(common) > 3 else "demo"
    logger.info("%s: %d runs, %d at a time (one process and thread each)", name, len(jobs), workers)
    weights = base if isinstance(base, str | Path) else base.state_dict()
    order = sorted(jobs, key=lambda job: -RECIPE_COST.get(job[0], 1.0))
    calls = {job: (weights, configs[job], *common) for job in order}
    results = run_in_workers(_train_run, calls, workers, _init_worker, progress)
    return [results[job] for job in jobs]


def usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may run on
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _init_worker(queue=None) -> None:
    global _progress_sink
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger(__name__).setLevel(logging.INFO)
    if queue is not None:
        _progress_sink = lambda *item: queue.put(item)  # noqa: E731 - the parent's `Progress.update`


def _train_run(
    base: CausalLM | dict[str, torch.Tensor] | str | Path,
    cfg: GRPOConfig,
    out: Path,
    warm: dict,
    tensorboard: bool = False,
    setup: RunSetup | None = None,
) -> Path:
    """One GRPO run from the warmed weights (a model, or its state dict or safetensors file in
    a worker process); returns its record's folder. The same numbers in a worker as in the
    parent: the run seeds everything it draws from, and each process has one intra-op thread.
    setup: the model, task and settings of the runs (None: the demo's)."""
    setup = setup or RunSetup()
    if isinstance(base, str | Path):  # allocated where it trains, no random init to overwrite
        model = empty_model(ModelConfig.from_hf(setup.model), device=cfg.device)
        model.load_state_dict(load_file(str(base), device=str(cfg.device)))
    elif isinstance(base, dict):
        model = build_model(setup.model, seed=0)
        model.load_state_dict(base)
    else:
        model = copy.deepcopy(base)
    recipe, seed, device = cfg.recipe, cfg.seed, cfg.device
    model = model.to(device)
    resolved = resolve_train(cfg, model, device)  # the run's choices, made once
    plan = resolved.plan
    record = ReportingRecord.create(
        out / "runs", f"{recipe}-seed{seed}-{time.strftime('%Y%m%dT%H%M%S')}",
        config={**plain(cfg), "warmup": warm, "task": setup.task_settings,
                "lr_schedule": setup.lr_schedule, "model": setup.model_name},
        plan_json=plan, backend=str(resolved.kernels.quantizer),
    )  # fmt: skip
    if tensorboard:
        attach_tensorboard(record, plan=plan)
    sink = _progress_sink
    if sink is not None:  # each metrics row, as it is written, to the parent's progress lines
        record.sink = lambda step, metrics: sink(*message(recipe, seed, step, metrics))
    with record.guard(lambda: 0):  # a failure before step 1 is recorded too
        trainer = GRPOTrainer(cfg, model, TaskSource(setup.task(seed)), record, resolved=resolved)
    # LambdaLR's k is the number of optimizer steps taken: step k + 1's learning rate
    schedule = torch.optim.lr_scheduler.LambdaLR(trainer.opt, lambda k: lr_factor(k + 1, cfg.steps))
    trainer.opt.register_step_post_hook(lambda *_: schedule.step())
    # the engine allocates its KV cache at the first generate()
    trainer.engine.cache_options = replace(
        trainer.engine.cache_options, kv_cache_bytes=setup.kv_cache_bytes
    )
    t0 = time.perf_counter()
    logger.info("%s: %s seed %d (%d steps)", setup.name, recipe, seed, cfg.steps)
    trainer.run()
    logger.info("%s: %s seed %d done (%.0f s)", setup.name, recipe, seed, time.perf_counter() - t0)
    return record.path
