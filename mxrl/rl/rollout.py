"""The rollout seam of the GRPO trainer (docs/design.md §4.7): where rollouts run and how the
trainer's weights reach them.

- `LocalRollout`: one engine in this process, loaded through `InProcessTransport`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from mxrl.engine import Completion, Engine, SamplingParams
from mxrl.models import CausalLM
from mxrl.recipe import Plan
from mxrl.rl.config import GRPOConfig
from mxrl.rl.metrics import engine_digest
from mxrl.sync import InProcessTransport, SyncReport
from mxrl.weights import Export


class Rollout(Protocol):
    """Where rollouts run, how weights reach them. Every method is called on every rank."""

    engine: Engine | None  # this rank's engine; None on a train-only rank

    def generate(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
    ) -> list[Completion]: ...  # all, request order, every rank
    def update(self, export: Export | None) -> SyncReport | None: ...  # None: no actor here
    def holds(self, fresh: Mapping[str, str] | None) -> bool: ...  # the deep check
    def digest(self) -> tuple[str, bool]: ...  # (the engine digest, every engine holds it)
    def weights_version(self, step: int) -> int: ...
    def restore_version(self, version: int) -> None: ...


class LocalRollout:
    """One engine beside the trainer, built from the model it is handed and loaded in process."""

    def __init__(self, cfg: GRPOConfig, model: CausalLM, plan: Plan) -> None:
        self.engine = Engine(
            model, plan, device=cfg.device, backend=cfg.backend, tile=cfg.engine_tile,
            compute_dtype=cfg.torch_compute_dtype(),
        )  # fmt: skip
        self.transport = InProcessTransport(self.engine)

    def generate(
        self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams]
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
