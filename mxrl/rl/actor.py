"""The actor seam of the GRPO trainer (docs/design.md §4.7): where the master weights live, how
they are exported to the rollout and saved for a resume.

- `LocalActor`: the whole model in this process; resume files `checkpoints/step_NNNNNN.pt`.
- `ShardedActor`: a train rank of a placement (docs/scale.md): its FSDP2 shard of the model,
  exported through `mxrl.parallel.sharded_export` (the bytes of a one-process export), saved as
  distributed checkpoints (`checkpoints/step_NNNNNN/`, `mxrl.parallel.dcp`).

The trainer sees the train ranks through `TrainRanks`: on one process `OneRank`, whose every
collective is an identity, so the one step the trainer writes (in its distributed form)
computes on one process exactly the values it always did; on a placement `ShardedRanks`, whose
collectives run over the train group.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from mxrl.models import CausalLM
from mxrl.nn import apply_plan
from mxrl.rl.config import GRPOConfig
from mxrl.rl.optim import adamw
from mxrl.rl.resume import apply_optimizer_settings
from mxrl.weights import WHOLE_UPDATE, Export, export
from mxrl.weights.event import SqnrSample

if TYPE_CHECKING:
    from mxrl.parallel import Layout
    from mxrl.rl.resolve import Resolved

# mxrl.parallel (FSDP2, DCP, DTensor) is imported where a placement uses it, never at the top:
# a one-process run starts without torch.distributed's heavy modules (seconds).


class TrainRanks(Protocol):
    """The train ranks as the loss sees them."""

    size: int  # 1 on one process: every call below is an identity
    index: int

    def share(self, num_groups: int) -> range: ...  # the GRPO groups this rank trains
    def gather(self, rows: list[torch.Tensor]) -> list[torch.Tensor]: ...  # request order
    def sum(self, t: torch.Tensor) -> torch.Tensor: ...  # all-reduce over the train ranks
    def max(self, t: torch.Tensor) -> torch.Tensor: ...  # all-reduce (max) over them
    def full(self, t: torch.Tensor) -> torch.Tensor: ...  # a sharded tensor made whole


class OneRank:
    """The train ranks of one process: every group is this rank's, every collective is the
    tensor itself."""

    size = 1
    index = 0

    def share(self, num_groups: int) -> range:
        return range(num_groups)

    def gather(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(rows)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return t


class ShardedRanks:
    """The train ranks of a placement: collectives over its train group."""

    def __init__(self, layout: Layout) -> None:
        self.group, self.members, self.device = (
            layout.train_group,
            layout.train_ranks,
            layout.device,
        )
        self.size = len(layout.train_ranks)
        self.index = layout.train_ranks.index(layout.rank)

    def share(self, num_groups: int) -> range:
        from mxrl.parallel.shares import share

        return share(num_groups, self.size, self.index)

    def gather(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        from mxrl.parallel.shares import gather_in_order

        return gather_in_order(rows, self.members, group=self.group)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)  # NCCL reduces device memory
        dist.all_reduce(t, group=self.group)
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def full(self, t: torch.Tensor) -> torch.Tensor:
        from mxrl.parallel import full

        return full(t)  # DTensor.full_tensor: collective on its mesh


class Actor(Protocol):
    """Where the master weights live."""

    model: CausalLM  # plan applied
    optimizer: torch.optim.Optimizer  # the fused AdamW of mxrl/rl/optim.py
    ranks: TrainRanks
    # keys of a resume state that an older checkpoint may lack (the trainer warns)
    newer_keys: tuple[str, ...]

    def export(self, step: int, *, sqnr: bool | SqnrSample = True) -> Export: ...
    def save(self, folder: Path | None, step: int, state: dict[str, Any]) -> Path: ...
    def load(self, path: Path, state: dict[str, Any]) -> None: ...


def autocast_dtype(model: CausalLM, resolved: Resolved) -> torch.dtype | None:
    """The training forward's autocast dtype: the run's compute dtype (`resolved`), or, for
    float32, none (the parameters' dtype, unless the model was given one); the same on every
    placement."""
    compute = resolved.compute_dtype
    return compute if compute != torch.float32 else model.compute_dtype


class LocalActor:
    """The whole model on this process: the plan applied, the run's compute dtype, the fused
    AdamW; resume files written with `torch.save`."""

    newer_keys = ("rng",)

    def __init__(
        self, cfg: GRPOConfig, model: CausalLM, resolved: Resolved, hold: bool | None = None
    ) -> None:
        """hold: the memory estimate's choice for rl.hold_bf16_weights auto (None: held); true
        or false in the config are taken as given."""
        self.cfg, self.model, self.plan = cfg, model, resolved.plan
        given = cfg.hold_bf16_weights
        hold = given if isinstance(given, bool) else hold is not False
        self.ranks = OneRank()
        apply_plan(model, self.plan, backend=resolved.kernels)
        model.set_training_options(
            compute_dtype=autocast_dtype(model, resolved),
            checkpoint_layers=cfg.checkpoint_layers,
            hold_bf16_weights=hold,
        )
        self.optimizer = adamw(
            model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )

    def export(self, step: int, *, sqnr: bool | SqnrSample = True) -> Export:
        # for this process's engine (LocalRollout): one bucket, one host read of its checksums
        return export(self.model, self.plan, step=step, sqnr=sqnr, bucket_bytes=WHOLE_UPDATE)

    def save(self, folder: Path | None, step: int, state: dict[str, Any]) -> Path:
        """folder/step_NNNNNN.pt: the trainer's `state` with the weights, the optimizer and the
        RNGs, written to a temporary name and renamed, so a run killed at any moment leaves only
        whole checkpoints."""
        assert folder is not None  # one process writes the record
        folder.mkdir(exist_ok=True)
        path = folder / f"step_{step:06d}.pt"
        tmp = path.with_suffix(".tmp")
        rest = {k: v for k, v in state.items() if k != "step"}
        whole = {"step": state["step"], "model": self.model.state_dict(),
                 "opt": self.optimizer.state_dict(), **rest,
                 "rng": rng_state(torch.device(self.cfg.device))}  # fmt: skip
        torch.save(whole, tmp)
        tmp.rename(path)
        return path

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """The weights, the optimizer (with this config's lr, betas and weight decay: a resume
        applies a changed setting) and the RNGs of a loaded `step_NNNNNN.pt` (a file from
        before the RNG key leaves them as seeded)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["opt"])  # moves the moments to the params' device
        apply_optimizer_settings(self.optimizer, self.cfg)
        if "rng" in state:
            set_rng_state(state["rng"], torch.device(self.cfg.device))


class ShardedActor:
    """A train rank of a placement: the plan applied, then its FSDP2 shard of the model
    (`parallelize`), the fused AdamW over the shards (the quantized-weight caches cleared after
    each step); distributed checkpoints."""

    newer_keys = ()  # every distributed checkpoint has the RNG and engine keys

    def __init__(
        self, cfg: GRPOConfig, model: CausalLM, resolved: Resolved, layout: Layout
    ) -> None:
        self.cfg, self.plan, self.layout = cfg, resolved.plan, layout
        from mxrl.parallel import parallelize
        from mxrl.parallel.parallelize import attach_cache_reset

        self.ranks = ShardedRanks(layout)
        apply_plan(model, self.plan, backend=resolved.kernels)
        compute = autocast_dtype(model, resolved)  # as on one process
        self.model = parallelize(model, self.plan, layout.train_mesh, compute)
        # no held bf16 expert copies: each would be a whole unsharded weight on every rank
        model.set_training_options(compute_dtype=compute, checkpoint_layers=cfg.checkpoint_layers)
        self.optimizer = adamw(
            model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        attach_cache_reset(model, self.optimizer)

    def export(self, step: int, *, sqnr: bool | SqnrSample = True) -> Export:
        """Collective over the train ranks."""
        from mxrl.parallel import sharded_export

        layout = self.layout
        return sharded_export(self.model, self.plan, layout.train_group, step=step, sqnr=sqnr)

    def save(self, folder: Path | None, step: int, state: dict[str, Any]) -> Path:
        """A DCP checkpoint in `folder` (known to train rank 0, which writes the record): the
        shards of every train rank, `state` with the placement, each rank's RNGs."""
        from mxrl.parallel import dcp

        layout = self.layout
        box = [str(folder) if folder is not None else None]
        dist.broadcast_object_list(box, src=layout.train_ranks[0], group=layout.train_group)
        return dcp.save(
            Path(box[0]), step, self.model, self.optimizer, layout.train_group,
            trainer_state={**state, "placement": asdict(layout.placement)},
            rank_state=rng_state(layout.device),
        )  # fmt: skip

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """This rank's shards, optimizer (with this config's settings) and RNGs."""
        from mxrl.parallel import dcp
        from mxrl.parallel.parallelize import clear_quantized_caches

        rng = dcp.load(path, self.model, self.optimizer, self.layout.train_group)
        apply_optimizer_settings(self.optimizer, self.cfg)
        clear_quantized_caches(self.model)  # the loaded masters, not the caches of the old ones
        set_rng_state(rng, self.layout.device)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The global RNG states a resume restores: torch's CPU one, Python's, and the CUDA one of
    `device` on a CUDA run."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())  # torch.load may have mapped it to the device
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":  # a CUDA run resumed on the CPU has none
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
