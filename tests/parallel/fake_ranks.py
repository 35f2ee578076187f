"""Sharded masters and their collectives inside one process, for the edges of
mxrl/parallel/export.py: every rank a thread (tests/sync/fake_dist.py's FakeDist, with the
all-reduce and the all-gather into one tensor that the export calls), and a stand-in for FSDP2's
DTensor that holds the whole tensor and hands out this rank's rows of it.

mutmut's per-function test selection records only the functions a test calls in its own
process: the gloo ranks of test_export.py, spawned by torchrun, judge no mutant. The stand-in
shards as FSDP2 does (tests/parallel/uneven_worker.py holds the real rows: ceil(rows / ranks)
rows per rank, the last shorter or empty)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from tests.sync.fake_dist import FakeDist

GROUP = object()  # the train group the ranks pass (not the default group)


class FakeCollectives(FakeDist):
    """FakeDist plus `all_reduce` (SUM and MAX only, as the export uses) and
    `all_gather_into_tensor`; every rank must give a tensor of one shape and dtype, and the
    output must hold exactly world * input elements, as gloo wants."""

    ReduceOp = dist.ReduceOp

    def get_rank(self, group=None) -> int:
        """The rank in `group` (its index in `ranks`); the global rank for None, as
        torch.distributed."""
        if group is None:
            return self.local.rank
        self._check(group)
        return self.ranks.index(self.local.rank)

    def _swap(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's contribution, in group order (after all have given theirs)."""
        index = self.ranks.index(self.local.rank)
        self.slots[index] = t.clone()
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        for other in got:
            if other.shape != t.shape or other.dtype != t.dtype:
                raise RuntimeError(f"rank {self.local.rank}: {t.shape} beside {other.shape}")
        return got

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
        self._check(group, t)
        self._log("reduce", t.numel())
        got = self._swap(t)
        if op == dist.ReduceOp.SUM:
            t.copy_(torch.stack(got).sum(0))
        elif op == dist.ReduceOp.MAX:
            t.copy_(torch.stack(got).amax(0))
        else:
            raise RuntimeError(f"all_reduce: op {op!r} not stood in for")

    def all_gather_into_tensor(self, out: torch.Tensor, t: torch.Tensor, group=None) -> None:
        self._check(group, t, out)
        self._log("gather", t.numel())
        if out.numel() != len(self.ranks) * t.numel() or out.dtype != t.dtype:
            raise RuntimeError(f"all_gather_into_tensor: {out.shape} for {t.shape} a rank")
        got = self._swap(t)
        out.copy_(torch.cat([g.reshape(-1) for g in got]).reshape(out.shape))


class Sharded:
    """A DTensor as FSDP2 leaves it on one rank: `placements`, the whole `shape`, `to_local()`
    (rows ceil(rows / world) * rank onwards, a rank past the end empty), `full_tensor()`."""

    def __init__(self, whole: torch.Tensor, rank: int, world: int, placements=None) -> None:
        self.whole, self.rank, self.world = whole, rank, world
        self.placements = (Shard(0),) if placements is None else placements
        self.shape = whole.shape
        chunk = math.ceil(whole.shape[0] / world)
        start = min(rank * chunk, whole.shape[0])
        self.local = whole[start : start + chunk].clone()

    def detach(self) -> Sharded:
        return self

    def to_local(self) -> torch.Tensor:
        return self.local

    def full_tensor(self) -> torch.Tensor:
        return self.whole.clone()


class Model:
    """What sharded_export reads of a module: `named_parameters()`."""

    def __init__(self, params: dict[str, object]) -> None:
        self.params = params

    def named_parameters(self):
        return iter(self.params.items())


def shard_all(whole: dict[str, torch.Tensor], rank: int, world: int, placements=None) -> Model:
    """Every tensor of `whole` as this rank's Sharded; `placements` by name for other ones."""
    placements = placements or {}
    return Model({n: Sharded(t, rank, world, placements.get(n)) for n, t in whole.items()})


REPLICATED = (Replicate(),)
TWO_D = (Shard(0), Replicate())  # a 2-D mesh (HSDP): not FSDP2's one dim
BY_COLUMN = (Shard(1),)
