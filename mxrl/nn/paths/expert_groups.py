"""The engine's routed-expert dispatch (`ExpertGroups`): a batch's rows sorted by expert for the
grouped GEMMs of `mxrl.nn.paths.rollout`, and their outputs combined per token in ascending
expert order, the loop's order (docs/engine.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxrl.kernels import Backend
from mxrl.kernels.rowwise import (
    moe_combine,
    moe_combine_reference,
    moe_group,
    moe_group_reference,
)


@dataclass(frozen=True)
class ExpertGroups:
    """A batch's rows sorted by expert, as the engine's grouped GEMMs read them (a
    `mxrl.nn.moe.Dispatch`; `moe_group`'s integers): offsets int32 [E + 1], order [R] (each
    row's flat t * k + j), token_of [R], rows_Tk [T, k] (each token's rows in ascending expert
    order). `combine` sums a token's k outputs in that order, the loop's `index_add_` order;
    fused into one launch on the triton backend (the same bytes)."""

    offsets: torch.Tensor
    order: torch.Tensor
    token_of: torch.Tensor
    rows_Tk: torch.Tensor
    backend: Backend

    @classmethod
    def build(cls, ids_Tk: torch.Tensor, num_experts: int, backend: Backend) -> ExpertGroups:
        group = moe_group if backend is Backend.TRITON else moe_group_reference
        return cls(*group(ids_Tk, num_experts), backend)

    def gather(self, x_TH: torch.Tensor) -> torch.Tensor:
        return x_TH[self.token_of]

    def combine(self, h_RH: torch.Tensor, weights_Tk: torch.Tensor) -> torch.Tensor:
        combine = moe_combine if self.backend is Backend.TRITON else moe_combine_reference
        return combine(h_RH, weights_Tk.reshape(-1)[self.order], self.rows_Tk)
