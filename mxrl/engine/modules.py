"""The engine's weight-holding modules and batch-invariant token tiling.

Batch invariance by construction: every token-parallel op (norms, projections, router, experts)
runs on tiles of exactly `tile` tokens (the last one zero-padded), so each kernel sees the same
shapes whatever else is in the batch, and a row's result cannot depend on the other rows.
Attention runs per request on that request's own keys, with no padding in any reduction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mxrl.formats import QTensor
from mxrl.kernels import Backend
from mxrl.nn.experts import GroupedExperts
from mxrl.nn.qmatmul import QuantizedWeight, emulated_matmul
from mxrl.recipe import TensorSpec


def tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int) -> torch.Tensor:
    """fn applied to [tile, ...] slices of x [T, ...] (zero-padded), results concatenated."""
    t = x.shape[0]
    if t == 0:
        return fn(x.new_zeros((tile, *x.shape[1:])))[:0]
    pad = (-t) % tile
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    return torch.cat([fn(chunk) for chunk in x.split(tile)])[:t]


class RolloutLinear(nn.Module):
    """A projection holding what the engine received: a QTensor (plus the materialised GEMM
    operand) or a high-precision weight; the same emulated GEMM as the trainer's QLinear."""

    def __init__(self, spec: TensorSpec, compute_dtype: torch.dtype, backend: Backend) -> None:
        super().__init__()
        self.spec = spec
        self.compute_dtype = compute_dtype
        self.backend = backend
        self.qweight: QTensor | None = None
        self.wq: QuantizedWeight | None = None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def materialize(self, value: QTensor | torch.Tensor) -> dict:
        """What `install` will set, computed without touching the module (staging)."""
        if isinstance(value, QTensor):
            return {"qweight": value, "wq": QuantizedWeight.from_qtensor(value), "weight": None}
        return {"qweight": None, "wq": None, "weight": value.to(self.compute_dtype)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wq is not None:
            y = emulated_matmul(x.float(), self.wq, self.spec, self.backend)[0].to(x.dtype)
        else:
            assert self.weight is not None, f"{self.spec.name}: no weights loaded"
            y = F.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class RolloutExperts(nn.Module):
    """Grouped experts holding per-projection QTensors or weights; each expert's token group is
    tiled so that expert GEMM shapes never depend on how many tokens the batch routed there."""

    def __init__(
        self,
        experts: GroupedExperts,
        specs: dict[str, TensorSpec],
        dtype: torch.dtype,
        tile: int,
        backend: Backend,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.num_experts = experts.num_experts
        self.specs = specs
        self.compute_dtype = dtype
        self.tile = tile
        self.values: dict[str, QuantizedWeight | torch.Tensor | None] = dict.fromkeys(specs)

    def materialize(self, which: str, value: QTensor | torch.Tensor):
        if isinstance(value, QTensor):
            return QuantizedWeight.from_qtensor(value)
        return value.to(self.compute_dtype)

    def _linear(self, which: str, e: int, x: torch.Tensor) -> torch.Tensor:
        v = self.values[which]
        if isinstance(v, QuantizedWeight):
            y = emulated_matmul(x.float(), v.for_expert(e), self.specs[which], self.backend)[0]
            return y.to(x.dtype)
        assert v is not None, f"{self.specs[which].name}: no weights loaded"
        return F.linear(x, v[e])

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear("gate_up", e, x).chunk(2, dim=-1)
        return self._linear("down", e, F.silu(gate) * up)

    def forward(self, x_TH: torch.Tensor, ids_Tk: torch.Tensor, weights_Tk: torch.Tensor):
        k = ids_Tk.shape[1]
        flat = ids_Tk.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // k
        w = weights_Tk.reshape(-1)[order]
        out = torch.zeros_like(x_TH)
        start = 0
        for e, n in enumerate(counts):
            if n:
                idx = token_of[start : start + n]
                h = tiled(lambda t, e=e: self._expert(e, t), x_TH[idx], self.tile)
                out.index_add_(0, idx, h * w[start : start + n, None].to(h.dtype))
                start += n
        return out
