"""The trainer's two seams, built for this process (mxrl.rl.trainer's docstring): the actor
(`mxrl.rl.actor`: the master weights, their export and saving) and the rollout
(`mxrl.rl.rollout`: where rollouts run and how weights reach them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mxrl.engine import CacheOptions
from mxrl.models import CausalLM
from mxrl.rl.actor import Actor, LocalActor, ShardedActor
from mxrl.rl.config import GRPOConfig
from mxrl.rl.resolve import Resolved
from mxrl.rl.rollout import LocalRollout, RankRollout, Rollout

if TYPE_CHECKING:
    from mxrl.parallel import Layout


def build_seams(
    cfg: GRPOConfig, model: CausalLM, resolved: Resolved, layout: Layout | None,
    kv_bytes: int | None, hold: bool | None,
) -> tuple[Actor | None, Rollout]:  # fmt: skip
    """The actor (None on a rank that does not train) and the rollout of this process."""
    cache = CacheOptions(kv_cache_bytes=kv_bytes)
    if layout is None:
        actor = LocalActor(cfg, model, resolved, hold)  # the engine: from the model it prepared
        return actor, LocalRollout(model, resolved, cache)
    if cfg.prompts_per_step < max(len(layout.train_ranks), len(layout.rollout_ranks)):
        raise ValueError(
            f"rl.prompts_per_step {cfg.prompts_per_step} is smaller than the number of train "
            f"({len(layout.train_ranks)}) or rollout ({len(layout.rollout_ranks)}) ranks: "
            "every rank needs at least one prompt group"
        )
    rollout = RankRollout(model, resolved, layout, cache)  # the whole master, before sharding
    return (ShardedActor(cfg, model, resolved, layout) if layout.trains else None), rollout
