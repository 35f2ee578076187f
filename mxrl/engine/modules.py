"""The engine's fused row-wise swaps of the triton backend (RMSNorm, RoPE, the routers): one
launch each (mxrl.kernels.rowwise), and DeepSeek-V3's sigmoid router with its scores' GEMM on
the rollout path. The projections and experts the engine swaps in are the rollout GEMM path's
(`mxrl.nn.paths.rollout`).
"""

from __future__ import annotations

import torch

from mxrl.formats.constants import Format
from mxrl.kernels import Backend
from mxrl.kernels.rowwise import moe_route, rms_norm, rope
from mxrl.models.layers import ApplyRope, RMSNorm, TopKSoftmax
from mxrl.models.mla import GroupLimitedRouting, SigmoidRouter
from mxrl.nn import invariant
from mxrl.nn.paths.rollout import RolloutLinear
from mxrl.recipe import TensorSpec


class RolloutRMSNorm(RMSNorm):
    """The model's RMSNorm as one fused launch (mxrl.kernels.rowwise; triton backend)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RolloutRope(ApplyRope):
    """The model's RoPE on q and k as one fused launch (mxrl.kernels.rowwise; triton backend)."""

    def forward(self, q_BNSD, k_BKSD, cos_BSD, sin_BSD):
        return rope(q_BNSD, k_BKSD, cos_BSD, sin_BSD)


class RolloutTopK(TopKSoftmax):
    """The router's softmax top-k as one fused launch (mxrl.kernels.rowwise.moe_route: the
    reference's ids, weights within its stated bound; triton backend, E <= MAX_ROUTE_EXPERTS)."""

    def forward(self, logits_TE, dtype):
        return moe_route(logits_TE, self.top_k, self.norm_topk_prob, out_dtype=dtype)


class RolloutSigmoidRouter(GroupLimitedRouting, RolloutLinear):
    """DeepSeek-V3's router (`mxrl.models.mla.SigmoidRouter`): its weight held as an fp32
    RolloutLinear, so the scores' GEMM is tiled as every engine GEMM (batch invariance) and in
    fp32 as the trainer's; the selection and weights are the trainer's code
    (`GroupLimitedRouting`); e_score_correction_bias is loaded in fp32."""

    def __init__(
        self, router: SigmoidRouter, spec: TensorSpec, backend: Backend, tile: int
    ) -> None:
        if spec.format is not Format.BF16:
            raise ValueError(
                f"{spec.name} is {spec.format} in the plan; the sigmoid router takes bf16 only "
                "(keep kind router in bf16 in the recipe)"
            )
        RolloutLinear.__init__(self, spec, torch.float32, backend, tile)
        for attr in ("num_experts", "top_k", "n_group", "topk_group", "norm_topk_prob", "scaling"):
            setattr(self, attr, getattr(router, attr))
        self.e_score_correction_bias = None

    def scores(self, x_TH: torch.Tensor) -> torch.Tensor:
        """sigmoid(x W^T) in fp32, [T, E]."""
        return invariant.sigmoid(RolloutLinear.forward(self, x_TH.float()))
