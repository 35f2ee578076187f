"""Fused row-wise ops of the engine's decode step, one launch each instead of the 7–17 small
kernels eager PyTorch launches (a decode step of a small batch is bound by its kernel count:
docs/benchmarks.md, "Rollout"). Kernels in mxrl/kernels/triton_rowwise.py; each function here
has its PyTorch reference beside it, which is also what the CPU runs.

- `rms_norm`: HF Qwen's RMSNorm (fp32 statistics, cast back, times the weight). The kernel sums
  the squares in its own fixed order and takes a correctly rounded 1/sqrt, so its statistics
  differ from the reference's by reordering only: the output is within two roundings of the
  output dtype of the reference (tests/kernels/test_rowwise.py), and a row's bytes depend on
  that row only.
- `moe_combine`: each token's k expert outputs times their routing weights, summed in ascending
  expert order with every product and partial sum rounded to the output dtype — the eager
  loop's exact operations, so the same bytes.

Legend: R rows, H row length, T tokens, k experts per token.
"""

from __future__ import annotations

import torch

_MAX_NORM_ROW = 16384  # one program holds a whole row
_COMBINE_BLOCK = 1024


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """mxrl.models.layers.RMSNorm.forward, op for op."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] with weight [H] (same dtype as x), one launch."""
    from mxrl.kernels.triton_rowwise import rms_norm_kernel

    h = x.shape[-1]
    if weight.shape != (h,) or weight.dtype != x.dtype or h > _MAX_NORM_ROW:
        raise ValueError(
            f"rms_norm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}: the weight must be [H] in x's dtype, H <= {_MAX_NORM_ROW}"
        )
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], h), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = max(16, 1 << (h - 1).bit_length())
        rms_norm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), out, x2.stride(0), out.stride(0), h, eps,
            BLOCK=block, IS_BF16=x.dtype == torch.bfloat16, num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    return out.view(x.shape)


def moe_combine_reference(
    h_RH: torch.Tensor, w_R: torch.Tensor, row_of_Tk: torch.Tensor
) -> torch.Tensor:
    """out [T, H]: sum over j (ascending) of h[row_of[t, j]] * w[row_of[t, j]], in h's dtype."""
    h = h_RH * w_R[:, None].to(h_RH.dtype)
    out = torch.zeros((row_of_Tk.shape[0], h.shape[1]), dtype=h.dtype, device=h.device)
    for j in range(row_of_Tk.shape[1]):  # fixed order, element-wise: a token sees only its own
        out = out + h[row_of_Tk[:, j]]
    return out


def moe_combine(h_RH: torch.Tensor, w_R: torch.Tensor, row_of_Tk: torch.Tensor) -> torch.Tensor:
    """`moe_combine_reference` in one launch (the same bytes)."""
    from mxrl.kernels.triton_rowwise import moe_combine_kernel

    t, k = row_of_Tk.shape
    rows, hdim = h_RH.shape
    if w_R.shape != (rows,) or row_of_Tk.dtype != torch.int64:
        raise ValueError(
            f"moe_combine: h {tuple(h_RH.shape)}, w {tuple(w_R.shape)} (want [{rows}]), row_of "
            f"{row_of_Tk.dtype} (want int64 [T, k])"
        )
    h = h_RH if h_RH.stride(-1) == 1 else h_RH.contiguous()
    out = torch.empty((t, hdim), dtype=h.dtype, device=h.device)
    if t:
        block = min(_COMBINE_BLOCK, max(16, 1 << (hdim - 1).bit_length()))
        moe_combine_kernel[(t, -(-hdim // block))](
            h, w_R.to(h.dtype).contiguous(), row_of_Tk.contiguous(), out,
            h.stride(0), out.stride(0), hdim, K=k, BLOCK=block,
            IS_BF16=h.dtype == torch.bfloat16, num_warps=4,
        )  # fmt: skip
    return out
