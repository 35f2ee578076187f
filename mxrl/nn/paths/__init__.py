"""The GEMM paths a quantized module runs (docs/design.md §4.5): `reference` (fp32 emulated
GEMMs, `QMatmul`), `tensor_core` (bf16 tensor cores with fp32 accumulation, block FP8 on
`torch._scaled_mm`), `grouped` (grouped expert GEMMs with autograd) and `rollout` (the engine's
fixed-shape tiles, packed low-bit and block-FP8 GEMMs, no autograd).

`GemmPath` is the strategy a quantized layer hands its GEMMs to, and `path_for(gemm)` the
trainer's path for a `Gemm`. A trainer module holds its path (`path`, set by `set_gemm`; None:
`Kernels.train_gemm` by device, resolved per call; `gemm_choice`, read-only, names it).
`QLinear` runs its GEMM through it (`linear`) and `GroupedExperts` / `QExperts` their routed
experts (`experts`: the reference's loop, each quantized projection `ReferencePath.linear` on
one expert's slice; the tensor core's grouped GEMMs, each quantized projection
`TensorCorePath.grouped`, where the formats and shapes allow). The engine's `RolloutLinear` and
`RolloutExperts` run theirs through their `RolloutPath` (`rollout.py`: tiles, no autograd;
`linear` takes the same arguments, `master`, `mode` and `backend` unread; `experts` the loop or
one grouped launch per projection; no `gemm`: it is not a trainer path). Both forms of the
routed experts are `mxrl.nn.moe`'s.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from mxrl.kernels import Backend, Gemm
from mxrl.nn.paths.grouped import TensorCorePath
from mxrl.nn.paths.reference import ReferencePath
from mxrl.nn.weight import QWeight
from mxrl.recipe import Backward, TensorSpec


class GemmPath(Protocol):
    """What a quantized layer's GEMMs run on: `linear` computes y = Qa(x) (x) w, differentiable
    into `master` where `autograd`; `experts` a routed-experts module's output [T, H] for its
    tokens x_TH routed to ids_Tk with weights_Tk (calling back the module's `loop` or its
    `_grouped_proj`, which run their projections on this path or on GroupedExperts' own bf16
    GEMMs)."""

    gemm: Gemm
    autograd: bool

    def linear(
        self,
        x: torch.Tensor,
        w: QWeight,
        master: torch.Tensor,
        spec: TensorSpec,
        mode: Backward,
        backend: Backend,
    ) -> torch.Tensor: ...

    def experts(
        self,
        x_TH: torch.Tensor,
        ids_Tk: torch.Tensor,
        weights_Tk: torch.Tensor,
        experts: nn.Module,
    ) -> torch.Tensor: ...


PATHS: dict[Gemm, GemmPath] = {
    Gemm.REFERENCE: ReferencePath(),
    Gemm.TENSOR_CORE: TensorCorePath(),
}


def path_for(gemm: Gemm | str) -> GemmPath:
    """The trainer's path for `gemm` (one object per kind: the paths hold no state)."""
    return PATHS[Gemm(gemm)]


def set_gemm(model: nn.Module, gemm: Gemm | str | None) -> int:
    """Set the GEMM path of every training op of `model` (QLinear, GroupedExperts, QExperts:
    the modules with a `gemm_choice`; the engine's modules hold a `RolloutPath` and have none)
    to `path_for(gemm)`; None restores the device default (`path` None). Returns how many
    modules were set."""
    path = None if gemm is None else path_for(gemm)
    count = 0
    for module in model.modules():
        if hasattr(module, "gemm_choice"):
            module.path = path
            count += 1
    return count


__all__ = ["PATHS", "GemmPath", "ReferencePath", "TensorCorePath", "path_for", "set_gemm"]
