"""Where each role runs: the `placement` section of a train YAML and the process groups it makes.

    placement:
      mode: split            # colocated: every rank trains and serves rollouts
      train_ranks: 1         # split: ranks 0..train_ranks-1 train (one FSDP2 mesh) ...
      rollout_ranks: 1       # ... the next rollout_ranks serve rollouts (one engine each)
      backend: auto          # auto (nccl with CUDA, else gloo) | gloo | nccl

Launched by `torchrun --nproc-per-node N $(which mxrl) train --config FILE`: torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) gives each process its rank, and
`Layout.init` checks that the placement adds up to WORLD_SIZE before any group exists.
Rank 0 is always a train rank, and the only rank that writes the run record.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)

MODES = ("colocated", "split")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Placement:
    """How many ranks train and how many serve rollouts (docs/scale.md).

    colocated: every rank holds an FSDP2 shard of the trainer and a whole engine; train_ranks
    and rollout_ranks default to (and must equal) the world size. split: train ranks first,
    then rollout ranks, train_ranks + rollout_ranks == world size."""

    mode: str = "colocated"
    train_ranks: int | None = None
    rollout_ranks: int | None = None
    backend: str = "auto"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"placement.mode must be one of {MODES}, got {self.mode!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"placement.backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("train_ranks", "rollout_ranks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"placement.{name} must be an integer, got {value!r}")
            if value is not None and value < 1:
                raise ValueError(f"placement.{name} must be >= 1, got {value}")
        if self.mode == "split" and (self.train_ranks is None or self.rollout_ranks is None):
            raise ValueError("placement.mode split needs train_ranks and rollout_ranks")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            timeout = None
        if timeout is None or not 0 < timeout < float("inf"):
            raise ValueError(
                f"placement.timeout_s must be a finite number > 0, got {self.timeout_s!r}"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, where: str = "placement") -> Placement:
        raw = dict(raw or {})
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**raw)

    def ranks(self, world_size: int) -> tuple[list[int], list[int]]:
        """(train ranks, rollout ranks) for `world_size` processes; ValueError if they do not
        add up."""
        if self.mode == "colocated":
            for name in ("train_ranks", "rollout_ranks"):
                value = getattr(self, name)
                if value is not None and value != world_size:
                    raise ValueError(
                        f"placement.{name} is {value} but a colocated placement uses every "
                        f"rank ({world_size}, WORLD_SIZE): drop the key or use mode: split"
                    )
            everyone = list(range(world_size))
            return everyone, everyone
        assert self.train_ranks is not None and self.rollout_ranks is not None
        if self.train_ranks + self.rollout_ranks != world_size:
            raise ValueError(
                f"placement: train_ranks {self.train_ranks} + rollout_ranks "
                f"{self.rollout_ranks} != WORLD_SIZE {world_size}; launch with torchrun "
                f"--nproc-per-node {self.train_ranks + self.rollout_ranks} or change the counts"
            )
        return list(range(self.train_ranks)), list(range(self.train_ranks, world_size))


@dataclass
class Layout:
    """This process's place in a running job (built once by `Layout.init`).

    train_group / train_mesh: the FSDP2 ranks (None on a rank that does not train);
    sync_group: train rank 0 and every rollout rank (split only; the weight broadcast);
    device: this rank's device (cuda:LOCAL_RANK under nccl, else the CPU)."""

    placement: Placement
    rank: int
    world_size: int
    train_ranks: list[int]
    rollout_ranks: list[int]
    device: torch.device
    train_group: dist.ProcessGroup | None
    train_mesh: DeviceMesh | None
    sync_group: dist.ProcessGroup | None

    @property
    def colocated(self) -> bool:
        return self.placement.mode == "colocated"

    @property
    def trains(self) -> bool:
        return self.rank in self.train_ranks

    @property
    def serves(self) -> bool:
        return self.rank in self.rollout_ranks

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes the run record, metrics and the checkpoint's non-tensor state."""
        return self.rank == 0

    @classmethod
    def init(cls, placement: Placement, device: str = "cpu") -> Layout:
        """Initialise torch.distributed from torchrun's environment and build the groups.
        `device` is the train config's device: "cuda" gives each rank cuda:LOCAL_RANK."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError(
                "a placement section needs a torchrun launch: torchrun --nproc-per-node N "
                "$(which mxrl) train --config FILE (RANK / WORLD_SIZE are not set)"
            )
        world_size = int(os.environ["WORLD_SIZE"])
        train_ranks, rollout_ranks = placement.ranks(world_size)
        backend = placement.backend
        on_cuda = torch.device(device).type == "cuda"
        if backend == "auto":
            backend = "nccl" if on_cuda else "gloo"
        if backend == "nccl" and not on_cuda:
            raise ValueError("placement.backend nccl needs rl.device: cuda (NCCL moves GPU memory)")
        if on_cuda:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if local >= torch.cuda.device_count():
                raise ValueError(
                    f"LOCAL_RANK {local} but {torch.cuda.device_count()} CUDA device(s) visible: "
                    "launch at most one process per GPU"
                )
            dev = torch.device("cuda", local)
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(
                backend, timeout=timedelta(seconds=placement.timeout_s),
                device_id=dev if backend == "nccl" else None,
            )  # fmt: skip
        rank = dist.get_rank()
        # new_group is collective over the default group: every rank creates every group, in
        # one order, whether or not it is a member.
        train_group = _group(train_ranks, world_size)
        sync_group = None
        if placement.mode == "split":
            sync_group = dist.new_group([train_ranks[0], *rollout_ranks])
        mesh = None
        if rank in train_ranks:
            mesh = DeviceMesh.from_group(train_group, dev.type)
        logger.info(
            "rank %d/%d on %s: %s (train ranks %s, rollout ranks %s, %s)", rank, world_size,
            dev, _role(rank, train_ranks, rollout_ranks), train_ranks, rollout_ranks, backend,
        )  # fmt: skip
        return cls(
            placement, rank, world_size, train_ranks, rollout_ranks, dev,
            train_group if rank in train_ranks else None, mesh, sync_group,
        )  # fmt: skip

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _group(ranks: list[int], world_size: int) -> dist.ProcessGroup:
    """A group of `ranks` (the default group when they are the whole world)."""
    if len(ranks) == world_size:
        return dist.group.WORLD
    return dist.new_group(ranks)


def _role(rank: int, train: list[int], rollout: list[int]) -> str:
    return "+".join(r for r, member in (("train", train), ("rollout", rollout)) if rank in member)
