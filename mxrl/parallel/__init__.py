"""Multi-process placement (docs/scale.md): which ranks train and which serve rollouts
(`placement.py`), the trainer sharded with FSDP2 (`parallelize.py`), weight export from the
sharded masters (`export.py`), distributed checkpoints (`checkpoint.py`) and the data-parallel
rollout helpers (`rollout.py`). The GRPO trainer uses them through
`mxrl.rl.actor.ShardedActor` and `mxrl.rl.rollout.RankRollout`."""

from mxrl.parallel.export import ShardedExport, sharded_export
from mxrl.parallel.parallelize import full, layer_policy, local, parallelize, unshard_module
from mxrl.parallel.placement import Layout, Placement

__all__ = [
    "Layout",
    "Placement",
    "ShardedExport",
    "full",
    "layer_policy",
    "local",
    "parallelize",
    "sharded_export",
    "unshard_module",
]
