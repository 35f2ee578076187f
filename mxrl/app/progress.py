"""Progress of `mxrl demo`: each run's steps as they go, with an ETA for the whole demo.

Every run hands each metrics row it logs to a sink (`ReportingRecord`): in a worker process the
sink puts (recipe, seed, step, reward, held-out accuracy) on a queue the parent drains (`drain`);
in the parent it calls `Progress.update` directly. The parent logs one line per run every
`every` steps and at its last step:

    demo: mxfp8 seed 1  step 40/140  reward 0.58  held-out 0.41 (step 40)  | all runs 312/1260 steps, 2m05s, ETA 6m20s

reward: the mean reward of the steps since the run's previous line; held-out: its latest
evaluation. The ETA weighs each run's remaining steps by its recipe's relative cost (the
low-precision recipes emulate their formats on the CPU), at the pace measured so far.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mxrl.runs import RunRecord

logger = logging.getLogger("mxrl.app.demo")

Job = tuple[str, int]  # (recipe, seed)
# what a run sends per metrics row: recipe, seed, step, reward/mean, eval/accuracy (or None)
Message = tuple[str, int, int, float | None, float | None]


class ReportingRecord(RunRecord):
    """A RunRecord that also hands every metrics row it writes to `sink` (after writing it)."""

    sink: Callable[[int, Mapping[str, Any]], None] | None = None

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        super().log_metrics(step, metrics)
        if self.sink is not None:
            self.sink(step, metrics)


def message(recipe: str, seed: int, step: int, metrics: Mapping[str, Any]) -> Message:
    reward, heldout = metrics.get("reward/mean"), metrics.get("eval/accuracy")
    return (
        recipe,
        seed,
        step,
        None if reward is None else float(reward),
        None if heldout is None else float(heldout),
    )


@dataclass
class Progress:
    """The parent's view of every run. steps: each run's step count; cost: its relative cost
    (for the ETA); every: a line per run every this many steps, and at its last; clock: seconds
    (the ETA's)."""

    steps: dict[Job, int]
    cost: dict[Job, float]
    every: int
    clock: Callable[[], float] = time.perf_counter
    started: float = math.nan  # the clock at construction
    done: dict[Job, int] = field(default_factory=dict)
    rewards: dict[Job, list[float]] = field(default_factory=dict)
    heldout: dict[Job, tuple[int, float]] = field(default_factory=dict)
    name: str = "demo"  # the word each line starts with (`mxrl ablate`: "ablate")

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"progress every must be >= 1 step, got {self.every}")
        if math.isnan(self.started):
            self.started = self.clock()

    def update(self, recipe: str, seed: int, step: int, reward, heldout) -> None:
        job = (recipe, seed)
        if heldout is not None:
            self.heldout[job] = (step, heldout)
        if reward is None:  # the step-0 evaluation of the starting policy: not a step
            return
        self.done[job] = max(step, self.done.get(job, 0))
        self.rewards.setdefault(job, []).append(reward)
        total = self.steps.get(job, step)
        if step % self.every == 0 or step >= total:
            logger.info("%s", self.line(job, step, total))
            self.rewards[job] = []

    def line(self, job: Job, step: int, total: int) -> str:
        recipe, seed = job
        rewards = self.rewards.get(job) or [math.nan]
        parts = [
            f"{self.name}: {recipe} seed {seed}",
            f"step {step}/{total}",
            f"reward {sum(rewards) / len(rewards):.2f}",
        ]
        if job in self.heldout:
            at, acc = self.heldout[job]
            parts.append(f"held-out {acc:.2f} (step {at})")
        return "  ".join(parts) + f"  | {self.overall()}"

    def overall(self) -> str:
        done = sum(self.done.values())
        total = sum(self.steps.values())
        elapsed = self.clock() - self.started
        work = sum(self.done.get(j, 0) * self.cost.get(j, 1.0) for j in self.steps)
        all_work = sum(n * self.cost.get(j, 1.0) for j, n in self.steps.items())
        text = f"all runs {done}/{total} steps, {_duration(elapsed)}"
        if work > 0 and done < total:
            text += f", ETA {_duration(elapsed * (all_work - work) / work)}"
        return text


def run_in_workers(
    fn: Callable[..., Any],
    calls: Mapping[Job, tuple],
    workers: int,
    initializer: Callable[[Any], None],
    progress: Progress,
) -> dict[Job, Any]:
    """{job: fn(*args)} for `calls` ({job: args}, submitted in that order), in `workers` spawned
    processes, each started by `initializer(queue)`: the queue its runs put their `Message`s on,
    which a thread of this process feeds to `progress` until the pool is done."""
    context = multiprocessing.get_context("spawn")  # no fork of a process holding OpenMP
    queue = context.Queue()
    reader = threading.Thread(target=drain, args=(queue, progress), daemon=True)
    reader.start()
    try:
        with ProcessPoolExecutor(
            workers, mp_context=context, initializer=initializer, initargs=(queue,)
        ) as pool:
            futures = {job: pool.submit(fn, *args) for job, args in calls.items()}
            return {job: future.result() for job, future in futures.items()}
    finally:
        queue.put(None)  # after every worker's last message: the pool has shut down
        reader.join()


def drain(queue, progress: Progress) -> None:
    """Feed `progress` from a queue of `Message`s until a None (a thread of the parent)."""
    while (item := queue.get()) is not None:
        progress.update(*item)


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
