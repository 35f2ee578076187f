"""What a run decides once (docs/design.md §4.7): the plan, the kernels, the compute dtype and the
engine's options, resolved from the config and the model and handed down whole, so the plan the
CLI prints, checks and records is the one the trainer applies and the engine serves.

    resolved = resolve_train(cfg, model)  # mxrl train, the demo: once per run
    trainer = GRPOTrainer(cfg, model, source, record, resolved=resolved)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxrl.engine import EngineConfig
from mxrl.kernels import Kernels
from mxrl.models import CausalLM
from mxrl.recipe import Plan, resolve
from mxrl.rl.choices import ComputeDtype
from mxrl.rl.config import GRPOConfig


@dataclass(frozen=True)
class Resolved:
    """A run's choices, made once.

    plan: the recipe resolved on the model's parameters (applied by the actor, served by the
      engine, printed and recorded by the CLI).
    engine: the engine's options (device, compute dtype, GEMM tile, kernels); the rollout adds
      the KV cache's size. `kernels` and `compute_dtype` are read from it.
    """

    plan: Plan
    engine: EngineConfig

    @property
    def kernels(self) -> Kernels:
        """The `Kernels` record for the run's device (the quantizer, the engine's kernels)."""
        return self.engine.backend

    @property
    def compute_dtype(self) -> torch.dtype:
        """The engine's activations and KV cache, and the training forward's autocast."""
        return self.engine.compute_dtype


def compute_dtype_on(choice: ComputeDtype | str, device: torch.device | str) -> torch.dtype:
    """`rl.compute_dtype` on `device`: auto is bfloat16 on CUDA, float32 on the CPU."""
    choice = ComputeDtype(choice)
    if choice != ComputeDtype.AUTO:
        return getattr(torch, choice.value)
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_train(
    cfg: GRPOConfig, model: CausalLM, device: torch.device | str | None = None
) -> Resolved:
    """The run's choices for `model` on `device` (None: `cfg.device`; a rank of a placement
    passes its own). A backend the device cannot run is refused here (ValueError)."""
    device = torch.device(device if device is not None else cfg.device)
    plan = resolve(cfg.recipe, {n: p.shape for n, p in model.named_parameters()})
    engine = EngineConfig(
        device=device, compute_dtype=compute_dtype_on(cfg.compute_dtype, device),
        tile=cfg.engine_tile, backend=Kernels.resolve(cfg.backend, device),
        attention_split=cfg.engine_attention_split, dense_gemm=cfg.engine_dense_gemm,
    )  # fmt: skip
    return Resolved(plan, engine)
