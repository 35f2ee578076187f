"""An in-process stand-in for the torch.distributed calls of mxrl/sync/broadcast*.py: every rank a
thread of this process, broadcasts and all-gathers through queues and a barrier, each collective
logged. It lets the sync protocol run inside one pytest process (where mutmut's per-function
test selection sees it, unlike the spawned gloo ranks of test_broadcast.py), with stand-in
engines and hand-built updates. Sizes must match as in gloo: a receive of another length than
the broadcast fails the rank, where gloo would fail or hang."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

TIMEOUT_S = 20  # a rank waiting longer on a collective fails (a mutant out of step)
GRACE_S = 0.5  # how long the others may still run after a rank failed


class Work:
    def __init__(self, fake: FakeDist) -> None:
        self.fake, self.done = fake, False

    def wait(self) -> None:
        self.fake.pending.remove(self)
        self.done = True


@dataclass
class FakeDist:
    """One process group of `len(ranks)` ranks (their global ranks, in group order).

    log: (global rank, op, numel, pending) per collective, op "bcast" (the sender's),
    "recv" (a receiver's) or "gather"; pending: the sender's async broadcasts not yet waited
    for when it made the call."""

    ranks: tuple[int, ...] = (0, 1)
    backend: str = "gloo"
    log: list[tuple[int, str, int, int]] = field(default_factory=list)
    # called as edit(global rank, tensor) on what a rank contributes to an all-gather
    edit: Callable[[int, torch.Tensor], None] | None = None
    # the group object the ranks must pass (None: the default group), and the device every
    # tensor of a collective must be on (as NCCL wants CUDA tensors)
    group: object = None
    device: str | torch.device = "cpu"
    # CUDA: each receive's copy is queued behind a sleep of this many cycles on the receiving
    # device's current stream (where a real receive lands), so that whatever does not wait for
    # that stream reads the bytes before they are there
    delay_cycles: int = 0

    def __post_init__(self) -> None:
        self.Backend = dist.Backend
        self.local = threading.local()
        self.queues = {r: queue.Queue() for r in self.ranks}
        self.barrier = threading.Barrier(len(self.ranks), timeout=TIMEOUT_S)
        self.slots: list[torch.Tensor | None] = [None] * len(self.ranks)
        self.pending: list[Work] = []
        self.lock = threading.Lock()

    # --- what mxrl.sync calls ---------------------------------------------------------------
    def get_rank(self, group=None) -> int:
        return self.local.rank

    def get_world_size(self, group=None) -> int:
        self._check(group)
        return len(self.ranks)

    def get_backend(self, group=None) -> str:
        self._check(group)
        return self.backend

    def get_global_rank(self, group, index: int) -> int:
        if group is None:  # as torch.distributed: None is no registered group
            raise ValueError("Group None is not registered")
        self._check(group)
        return self.ranks[index]

    def _check(self, group, *tensors: torch.Tensor) -> None:
        if group is not self.group:
            raise RuntimeError(f"rank {self.local.rank}: a collective on another group")
        for t in tensors:
            if t.device != torch.device(self.device):
                raise RuntimeError(f"rank {self.local.rank}: a tensor on {t.device}")

    def broadcast(self, t: torch.Tensor, src: int, group=None, async_op: bool = False):
        self._check(group, t)
        if src not in self.ranks:
            raise RuntimeError(f"broadcast from src={src!r}, not a rank of the group")
        me = self.local.rank
        if me == src:
            self._log("bcast", t.numel())
            data = t.clone()
            for r in self.ranks:
                if r != src:
                    self.queues[r].put(data)
            if async_op:
                work = Work(self)
                self.pending.append(work)
                return work
            return None
        self._log("recv", t.numel())
        data = self.queues[me].get(timeout=TIMEOUT_S)
        if data.shape != t.shape or data.dtype != t.dtype:
            raise RuntimeError(f"rank {me}: receive of {t.shape} for a broadcast of {data.shape}")
        if self.delay_cycles and t.is_cuda:
            with torch.cuda.device(t.device):
                torch.cuda._sleep(self.delay_cycles)
                t.copy_(data)
        else:
            t.copy_(data)
        return Work(self) if async_op else None

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor, group=None) -> None:
        self._check(group, t, *out)
        self._log("gather", t.numel())
        index = self.ranks.index(self.local.rank)
        self.slots[index] = t.clone()
        if self.edit is not None:
            self.edit(self.local.rank, self.slots[index])
        self.barrier.wait()
        for i, o in enumerate(out):
            o.copy_(self.slots[i])
        self.barrier.wait()

    # --- the test's side --------------------------------------------------------------------
    def _log(self, op: str, numel: int) -> None:
        with self.lock:
            self.log.append((self.local.rank, op, numel, len(self.pending)))

    def ops(self, rank: int) -> list[tuple]:
        """rank's collectives, (op, numel), in order."""
        return [(op, n) for r, op, n, _ in self.log if r == rank]

    def run(self, **by_rank: Callable[[], object]) -> dict[int, object]:
        """Run each rank's function (keyword r<global rank>) in a thread of its own, as that
        rank; its result, or the exception it raised."""
        out: dict[int, object] = {}

        def body(rank: int, fn) -> None:
            self.local.rank = rank
            try:
                out[rank] = fn()
            except BaseException as e:  # handed to the test
                out[rank] = e

        threads = [
            threading.Thread(target=body, args=(int(k.removeprefix("r")), fn), daemon=True)
            for k, fn in by_rank.items()
        ]
        for t in threads:
            t.start()
        deadline, failed_at = time.monotonic() + 3 * TIMEOUT_S, None
        while any(t.is_alive() for t in threads):
            assert time.monotonic() < deadline, "a rank is stuck"
            if failed_at is None and any(isinstance(v, BaseException) for v in out.values()):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() > failed_at + GRACE_S:
                # a rank failed and another still waits on it: fail that one too, as gloo would
                # once its timeout passed
                self.barrier.abort()
                for q in self.queues.values():
                    q.put(torch.empty(0, dtype=torch.int8))  # a wrong size: a receive fails
                failed_at = float("inf")
            time.sleep(0.002)
        # ready for the next run: a failed rank broke the barrier and left junk in the queues
        self.barrier.reset()
        self.leftover = 0
        for q in self.queues.values():
            while not q.empty():
                self.leftover += q.get().numel() > 0
        return out
