"""Distributed checkpoints: the sharded model and optimizer through torch.distributed.checkpoint
(DCP), the rest of the run's state beside them.

    runs/<id>/checkpoints/step_000020/
      .metadata, __0_0.distcp, ...   DCP: model and AdamW state, each train rank its own shards
      trainer.pt                     rank 0: step, data stream, spike detector, engine version
                                     and digest, plan hash, config (identical on every rank)
      rng_rank{r}.pt                 each train rank's RNG states

Written into `step_NNNNNN.tmp/` and renamed by rank 0 once every train rank has finished, so a
run killed at any moment leaves only whole checkpoints (as `mxrl.rl.actor.LocalActor` does for one file).
Loading reads the shards into the model and optimizer as they are sharded now (DCP reshards if
the number of train ranks changed; the optimizer's moments follow their parameters).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

TRAINER_STATE = "trainer.pt"


def checkpoint_dir(folder: Path, step: int) -> Path:
    return folder / f"step_{step:06d}"


def save(
    folder: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup,
    *,
    trainer_state: dict[str, Any],
    rank_state: dict[str, Any],
) -> Path:
    """Collective over the train group `group`; `trainer_state` is written by its rank 0."""
    final = checkpoint_dir(folder, step)
    tmp = final.with_name(final.name + ".tmp")
    first = dist.get_rank(group) == 0
    if first:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing it
        tmp.mkdir()
    dist.barrier(group=group)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp, process_group=group)
    torch.save(rank_state, tmp / f"rng_rank{dist.get_rank(group)}.pt")
    if first:
        torch.save(trainer_state, tmp / TRAINER_STATE)
    dist.barrier(group=group)
    if first:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier(group=group)
    return final


def load(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup
) -> dict[str, Any]:
    """Restore model and optimizer shards from `path` (collective over `group`); returns this
    rank's RNG state (`rank_state` of `save`)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    own = path / f"rng_rank{dist.get_rank(group)}.pt"
    if not own.exists():
        raise ValueError(
            f"{path} has no {own.name}: it was written by fewer train ranks; resume with the "
            "same placement (the RNG states are per rank)"
        )
    return torch.load(own, map_location="cpu", weights_only=False)


def load_model(path: Path, model: nn.Module) -> None:
    """Read the model of a checkpoint into `model`, whole, in one process with no process group
    (`mxrl convert --model runs/<id>`): DCP gathers every train rank's shards."""
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state["model"])


def trainer_state(path: Path) -> dict[str, Any]:
    """The rank-0 state of a checkpoint (every rank may read it: a shared file system)."""
    return torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)


def latest(run_dir: str | Path, checkpoints: str = "checkpoints") -> Path | None:
    found = sorted(
        p
        for p in (Path(run_dir) / checkpoints).glob("step_*")
        if p.is_dir() and not p.name.endswith(".tmp") and (p / TRAINER_STATE).exists()
    )
    return found[-1] if found else None
