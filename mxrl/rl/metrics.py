"""The metrics of one GRPO step (docs/runs.md), the engine digest the sync events carry, and the
one progress line per step on stderr."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from mxrl.engine import Completion

logger = logging.getLogger(__name__)


GIB = float(1 << 30)


def memory_peak(device: torch.device | str) -> float:
    """GiB: on CUDA the most memory torch allocated on `device` since the previous call (the
    counter is reset), on the CPU the process's peak resident set so far (the kernel keeps no
    other peak). The trainer calls it after each stage of a step: `memory/<stage>_peak_gib`."""
    device = torch.device(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / GIB
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # KiB on Linux


class GcPauses:
    """The Python garbage collector's pauses in this process (seconds, collections) since the
    clock was installed (`gc.callbacks`): `time/gc_s` of a step. The loop allocates Python
    objects at every decode step and every full collection walks all live ones, so the pauses
    grow with the rollout's length and the process's heap; nothing else reports them."""

    def __init__(self) -> None:
        self.seconds, self.collections, self.start, self.installed = 0.0, 0, 0.0, False
        self.by_generation: dict[int, list] = {}  # generation -> [collections, seconds]

    def install(self) -> GcPauses:
        """Start counting (once per process; the clock is shared)."""
        if not self.installed:
            gc.callbacks.append(self.callback)
            self.installed = True
        return self

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.start = time.perf_counter()
        else:
            paused = time.perf_counter() - self.start
            self.seconds += paused
            self.collections += 1
            row = self.by_generation.setdefault(info["generation"], [0, 0.0])
            row[0] += 1
            row[1] += paused


GC_PAUSES = GcPauses()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Every object alive on entry (imported modules, the model, the engine, the optimizer: ~300k
    tracked objects) out of the collector's walks until exit (`gc.freeze()`, as serving engines
    do after start-up): a full collection walks the whole heap, 157 ms a walk after a tiny-model
    rollout on a CPU (docs/benchmarks.md). The heap is collected in full first: garbage frozen
    with it would stay until the exit, and a run's predecessor in the same process (the ablation's
    previous preset: its model and engine on the device) would hold its memory through this run."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def settle(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (CUDA runs kernels after the host returns): each
    stage's time is then its own, not partly the next stage's (the optimizer step's kernels
    used to run inside the timed sync). Nothing on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_metrics(
    outs: Sequence[Completion],
    rewards: torch.Tensor,
    mask: torch.Tensor,
    mismatch: dict[str, float],
    stats: dict[str, float],
    grad_norm: float,
    decision: dict[str, float],
    times: tuple[float, float, float],
    elapsed: float,
    version: int,
) -> dict[str, float]:
    """The metrics of one GRPO step (docs/runs.md), the single-process and the distributed
    trainer alike. times: (rollout, train, sync) seconds; elapsed: the whole step's."""
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "accuracy": float((rewards > 0.5).float().mean()),
        "response_len/mean": float(mask.sum(-1).mean()),
        **mismatch,
        "loss/clip_frac": stats["loss/clip_frac"],
        "loss/pg": stats["loss/pg"],
        "grad/norm": grad_norm,
        **decision,
        "time/rollout_s": times[0],
        "time/train_s": times[1],
        "time/sync_s": times[2],
        "throughput/tokens_per_s": sum(len(o.tokens) + len(o.prompt) for o in outs) / elapsed,
        "sync/version": float(version),
    }
    for key in ("tis/mean_weight", "tis/clipped_frac", "mis/masked_frac"):
        if key in stats:
            metrics[key] = stats[key]
    return metrics


class Progress:
    """One line per GRPO step on the `mxrl.rl.metrics` logger (on every placement,
    by the rank that writes the record): step/total, reward, accuracy, mismatch, gradient norm, the
    step's time and an ETA from the mean step time of this process so far."""

    def __init__(self, start_step: int, steps: int) -> None:
        self.start_step, self.steps = start_step, steps
        self.t0 = time.perf_counter()

    def log(self, step: int, m: dict[str, float]) -> None:
        done = step - self.start_step
        mean = (time.perf_counter() - self.t0) / max(done, 1)
        logger.info(
            "step %d/%d reward %.3f acc %.2f k3 %.2e grad %.3f (%.1fs) ETA %s",
            step, self.steps, m["reward/mean"], m["accuracy"], m["mismatch/k3"], m["grad/norm"],
            m["time/rollout_s"] + m["time/train_s"] + m["time/sync_s"],
            format_eta(mean * (self.steps - step)),
        )  # fmt: skip


def format_eta(seconds: float) -> str:
    """`45s`, `3m05s`, `2h07m`: the time left, rounded to whole seconds (minutes past 1 h)."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
