"""The rollout seam of the GRPO trainer (docs/design.md §4.7): where rollouts run and how the
trainer's weights reach them.

- `LocalRollout`: one engine in this process, loaded through `InProcessTransport`.
- `RankRollout`: a rank of a placement (docs/scale.md). Each rollout rank serves a contiguous
  share of the step's prompt groups on its own engine and every rank gets all completions in
  request order; colocated, each rank loads its engine in process; split, train rank 0
  broadcasts the buckets to the rollout ranks (`BroadcastSender`, `BroadcastReceiver`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from mxrl.engine import CacheOptions, Completion, Engine, SamplingParams
from mxrl.models import CausalLM
from mxrl.sync import BroadcastReceiver, BroadcastSender, InProcessTransport, SyncReport
from mxrl.weights import Export
from mxrl.weights.digest import weights_digest as engine_digest

if TYPE_CHECKING:
    from mxrl.parallel import Layout
    from mxrl.rl.resolve import Resolved

# mxrl.parallel is imported where a placement uses it (rl/actor.py says why)

logger = logging.getLogger(__name__)


class Rollout(Protocol):
    """Where rollouts run, how weights reach them. Every method is called on every rank."""

    engine: Engine | None  # this rank's engine; None on a train-only rank

    def generate(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], group: int = 1
    ) -> list[Completion]: ...  # all, request order, every rank; shared by whole groups
    def update(self, export: Export | None) -> SyncReport | None: ...  # None: no actor here
    def holds(self, fresh: Mapping[str, str] | None) -> bool: ...  # the deep check
    def digest(self) -> tuple[str, bool]: ...  # (the engine digest, every engine holds it)
    def weights_version(self, step: int) -> int: ...
    def restore_version(self, version: int) -> None: ...


class LocalRollout:
    """One engine beside the trainer, built from the model it is handed and loaded in process."""

    def __init__(
        self, model: CausalLM, resolved: Resolved, cache: CacheOptions | None = None
    ) -> None:
        self.engine = Engine(model, resolved.plan, resolved.engine, cache=cache)
        self.transport = InProcessTransport(self.engine)

    def generate(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], group: int = 1
    ) -> list[Completion]:
        return self.engine.generate(prompts, params)

    def update(self, export: Export | None) -> SyncReport:
        # the engine verifies every record's checksum against its name and bytes before taking
        # the update (all or nothing): that is the hot path's one verification
        assert export is not None  # one process: the actor is here
        return self.transport.send(export)

    def holds(self, fresh: Mapping[str, str] | None) -> bool:
        """The deep check: the bytes the engine holds, hashed again, are `fresh` (name ->
        checksum of a fresh export of the master weights)."""
        assert fresh is not None
        return all(fresh.get(r.name) == r.hash for r in self.engine.records())

    def digest(self) -> tuple[str, bool]:
        return engine_digest(self.engine.hashes.items()), True

    def weights_version(self, step: int) -> int:
        return self.engine.weights_version

    def restore_version(self, version: int) -> None:
        # Engine.load_weights counts loads in this process (one when the engine was built, one
        # per sync): a resumed engine continues at the version the run's engine had
        self.engine.weights_version = version


class RankRollout:
    """This rank's part of the rollouts of a placement. The engine (on a rollout rank) is built
    from the whole master before the actor shards it."""

    def __init__(
        self,
        model: CausalLM,
        resolved: Resolved,
        layout: Layout,
        cache: CacheOptions | None = None,
    ) -> None:
        self.layout = layout
        self.engine: Engine | None = None
        if layout.serves:
            self.engine = Engine(model, resolved.plan, resolved.engine, cache=cache)
        self.transport = self.sender = self.receiver = None
        src = layout.train_ranks[0]
        if layout.colocated:
            assert self.engine is not None
            self.transport = InProcessTransport(self.engine)
        elif layout.rank == src:
            self.sender = BroadcastSender(layout.sync_group, src=src)
        elif self.engine is not None:
            self.receiver = BroadcastReceiver(self.engine, layout.sync_group, src=src)

    def generate(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], group: int = 1
    ) -> list[Completion]:
        """This rollout rank's contiguous share of the whole `group`s of requests on its
        engine; every rank's completions (routing records ride along) to every rank, in
        request order. A request's seed is in its params, so where it runs does not matter."""
        from mxrl.parallel.shares import gather_in_order, share

        layout, mine = self.layout, []
        if self.engine is not None:
            ranks = layout.rollout_ranks
            groups = share(len(prompts) // group, len(ranks), ranks.index(layout.rank))
            idx = [g * group + j for g in groups for j in range(group)]
            mine = self.engine.generate([prompts[i] for i in idx], [params[i] for i in idx])
        return gather_in_order(mine, layout.rollout_ranks)

    def update(self, export: Export | None) -> SyncReport | None:
        """The weights into every engine; the SyncReport where an export was sent (every
        colocated rank, train rank 0 of a split), None elsewhere."""
        if self.transport is not None:
            assert export is not None  # colocated: every rank trains
            return self.transport.send(export)
        if self.sender is not None:
            assert export is not None
            return self.sender.send(export)
        if self.receiver is not None:
            self.receiver.receive()
            return None
        assert export is not None  # another train rank of a split: its part of the collectives
        for _ in export:
            pass
        return None

    def holds(self, fresh: Mapping[str, str] | None) -> bool:
        """The deep check on every engine: train rank 0's fresh checksums broadcast to every
        rank, each engine's verdict gathered (collective over all ranks)."""
        from mxrl.parallel.shares import gather_objects

        box = [fresh]
        dist.broadcast_object_list(box, src=self.layout.train_ranks[0])
        ok = True
        if self.engine is not None:
            ok = all(box[0].get(r.name) == r.hash for r in self.engine.records())
        return all(gather_objects(ok))

    def digest(self) -> tuple[str, bool]:
        """The engine digest of every serving rank, gathered (collective over all ranks); an
        error is logged when they differ (the sync event then says not ok)."""
        from mxrl.parallel.shares import gather_objects

        mine = engine_digest(self.engine.hashes.items()) if self.engine is not None else None
        served = {d for d in gather_objects(mine) if d is not None}
        if len(served) != 1 and self.layout.is_writer:
            logger.error("engine ranks hold different weights: %s", sorted(served))
        return min(served), len(served) == 1

    def weights_version(self, step: int) -> int:
        return step + 1  # every engine loads once at build and once a step (the loop's numbering)

    def restore_version(self, version: int) -> None:
        if self.engine is not None:
            self.engine.weights_version = version


def request_seed(seed: int, step: int, index: int) -> int:
    """A per-request sampling seed that depends only on (run seed, step, request index)."""
    return (seed * 1_000_003 + step * 10_007 + index) % (2**63 - 1)
