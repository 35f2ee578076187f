"""Grouped SwiGLU experts, stored fused as transformers >= 5 stores them.

Legend: T tokens, H hidden, I expert intermediate size, E experts, k experts per token.
  gate_up_proj [E, 2I, H]   rows 0..I-1 of expert e are gate_proj, rows I..2I-1 up_proj
  down_proj    [E, H, I]
`forward` hands the module to its GEMM path (`mxrl.nn.paths`, `GemmPath.experts`), which runs
one of the dispatch's two forms (`mxrl.nn.moe`): the loop (`loop`: tokens grouped by expert,
each expert on its tokens, the weighted outputs added back with index_add) is the reference's
(`Gemm.REFERENCE`, the CPU default); with `Gemm.TENSOR_CORE` (the default on CUDA sm_90+) both
projections run as grouped GEMMs instead where `grouped_fits` (`mxrl.nn.paths.grouped`:
`_grouped_proj`), with no Python loop and no host sync. `QExperts` (mxrl.nn.qlinear) overrides
`_gate_up`, `_down` and `_grouped_proj` to run the quantized GEMMs; the routing and reduction
are shared.

The grouped bf16 projections read a bf16 copy of their fp32 master. `hold_bf16` False: cast
where each GEMM runs (the forward's and the dgrad's: two casts a micro-batch, nothing held);
True (`CausalLM.set_training_options(hold_bf16_weights=True)`): cast once per optimizer step and
held (`WeightCache`) for every forward and backward until the weights change, at 2 bytes a
weight. Same bytes either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mxrl.kernels.backend import Backend, Gemm
from mxrl.nn import invariant
from mxrl.nn.gemm import resolved_gemm
from mxrl.nn.moe import moe_loop
from mxrl.nn.paths import GemmPath, path_for
from mxrl.nn.paths.grouped import GroupedLinear, grouped_supported
from mxrl.nn.weight import WeightCache

# The two expert projections by role (the keys QExperts and the engine keep their specs under)
# and the parameter each is stored in: a plan names them `{experts module}.{parameter}`.
EXPERT_PARAMS = {"gate_up": "gate_up_proj", "down": "down_proj"}


class GroupedExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        kw = {"dtype": dtype, "device": device}
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw)
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, **kw)
        )
        self.path: GemmPath | None = None  # None: by device (mxrl.kernels.Kernels.resolve)
        # TRITON: the grouped form's permutation kernels (mxrl.nn.paths.permute), set by
        # apply_plan with the norms' (the same bytes but the routing weights' gradient)
        self.rowwise = Backend.REFERENCE
        self.set_hold_bf16(False)

    def set_hold_bf16(self, hold: bool) -> None:
        """Hold the grouped GEMMs' bf16 weight copies from one optimizer step to the next (module
        docstring). Either way it starts from empty caches: off frees the held copies, on makes
        them at the next forward."""
        self.hold_bf16 = hold
        self._bf16 = {which: WeightCache() for which in EXPERT_PARAMS}

    def bf16_weight(self, which: str) -> torch.Tensor | None:
        """Projection `which`'s held bf16 weight, cast when the master changed (`WeightCache`:
        every optimizer step, any in-place write); None when not `hold_bf16` (cast per GEMM)."""
        if not self.hold_bf16:
            return None
        param = getattr(self, EXPERT_PARAMS[which])
        return self._bf16[which].get((param,), lambda: param.detach().to(torch.bfloat16))

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=std)

    def forward(
        self, x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor
    ) -> torch.Tensor:
        return self.gemm_path(x_TH.device).experts(x_TH, topk_ids_Tk, topk_weights_Tk, self)

    @property
    def gemm_choice(self) -> Gemm | None:
        """The held path's `Gemm`, None by device (read-only: `set_gemm` sets the path)."""
        path = getattr(self, "path", None)  # None too for a module from before the paths
        return None if path is None else path.gemm

    def gemm_path(self, device: torch.device) -> GemmPath:
        """The path this module's GEMMs run on `device`: the one it holds, else the device's
        (`mxrl.nn.paths.path_for`)."""
        gemm = resolved_gemm(self.gemm_choice, device)
        path = getattr(self, "path", None)
        return path if path is not None else path_for(gemm)

    def loop(
        self, x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor
    ) -> torch.Tensor:
        """The loop form (`moe_loop`), each expert through `_gate_up` and `_down`."""
        return moe_loop(x_TH, topk_ids_Tk, topk_weights_Tk, self.num_experts, self._expert)

    def _expert(self, e: int, x_nH: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(e, x_nH).chunk(2, dim=-1)
        return self._down(e, invariant.silu_mul(gate, up))

    def grouped_fits(self, device: torch.device) -> bool:
        """Whether the grouped GEMMs take these experts' formats and shapes on `device` (the
        tensor-core path runs them where they do)."""
        dims = (self.hidden_size, self.intermediate_size)
        backward = getattr(self, "backward_mode", None)
        return grouped_supported(self._grouped_specs(), dims, device, backward)

    def _grouped_specs(self) -> dict:
        return {"gate_up": None, "down": None}

    def _grouped_proj(self, which: str, x_sorted: torch.Tensor, layout) -> torch.Tensor:
        param = getattr(self, EXPERT_PARAMS[which])
        held = self.bf16_weight(which)
        return GroupedLinear.apply(x_sorted, param, layout, held, None, None, None)

    def _gate_up(self, e: int, x_nH: torch.Tensor) -> torch.Tensor:
        return F.linear(x_nH, self.gate_up_proj[e])

    def _down(self, e: int, h_nI: torch.Tensor) -> torch.Tensor:
        return F.linear(h_nI, self.down_proj[e])

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}"
        )
