"""The emulated block-scaled GEMM (docs/design.md §2): the one reference formula that the trainer's
quantized ops (`mxrl.nn.paths.reference`) and the rollout GEMMs' reference backend compute.

    y = fl( (lp_x @ lp_w^T)_fp32  *  fl(s_x * s_w) )

lp_x [T, K], lp_w [N, K]: the operands dequantized *without* NVFP4's FP32 global scale (exact in
fp32); s_x ([T, 1] per token, [] per tensor, or None) and s_w ([] or [1, N], or None) the decode
global scales, a missing one read as 1. A native block-scaled GEMM computes the same up to the
order of the fp32 sums.
"""

from __future__ import annotations

import torch


def apply_global_scales(
    y: torch.Tensor, s_x: torch.Tensor | None, s_w: torch.Tensor | None
) -> torch.Tensor:
    """y * fl(s_x * s_w), the missing scale read as 1; y unchanged when both are missing."""
    if s_x is None and s_w is None:
        return y
    one = torch.ones((), device=y.device)
    return y * ((s_x if s_x is not None else one) * (s_w if s_w is not None else one))


def emulated_gemm(
    lp_x: torch.Tensor,
    lp_w: torch.Tensor,
    s_x: torch.Tensor | None = None,
    s_w: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 y [T, N] of the module docstring (lp_x, lp_w fp32)."""
    return apply_global_scales(lp_x @ lp_w.t(), s_x, s_w)
