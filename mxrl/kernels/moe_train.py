"""The trainer's MoE permutation around its grouped GEMMs, one Triton launch each (kernels in
triton_moe_train.py) instead of eager PyTorch's chains, each of which reads and writes the
[R, H] rows (R = T k: at 16 x 1024 tokens of Qwen3-30B-A3B, 537 MB a layer in bf16):

- `unpermute` (the combine): each token's k down-projection rows times their routing weights,
  summed. Eager: an index_select, a product and a sum over [T, k, H] forward; backward a
  product, a product and a sum for the weights' gradient, and index_add into zeros.
- `permute_backward` (the gather's backward): each token's k row gradients summed. Eager: an
  index_select, a cast to x's dtype and a sum over [T, k, H].

The references beside them fix the bytes, and are what the CPU runs: every sum over the slots
adds the k terms in slot order into an fp32 accumulator that starts at +0 (eager `sum(1)`
picks its order by shape and device: CUDA's differs from the CPU's, and so does the CPU's at
some widths). The kernels compute the same bytes, with one exception: the routing weights'
gradient, a sum over H in the kernel's order, is within `unpermute_weight_grad_bound` of the
reference's. fp32 launches are compiled without contraction (no FMA).

Legend: T tokens, k experts per token, R = T k rows sorted by expert, H hidden; inverse [R]
int64: the sorted row of (token t, slot j) at t k + j.
"""

from __future__ import annotations

import torch

_BF16 = torch.bfloat16
_BLOCK = 1024
_MAX_ROW = 16384  # unpermute_backward: one program holds a token's whole row


def unpermute_reference(
    h_RH: torch.Tensor, w_Tk: torch.Tensor, inverse: torch.Tensor
) -> torch.Tensor:
    """out [T, H] in h's dtype = sum over slots j (in order) of h[inverse[t k + j]] * w[t, j]:
    each product rounded to h's dtype, fp32 sums from +0, one rounding."""
    t, k = w_Tk.shape
    p = h_RH.index_select(0, inverse).view(t, k, -1) * w_Tk.to(h_RH.dtype)[..., None]
    acc = torch.zeros((t, p.shape[-1]), dtype=torch.float32, device=p.device)
    for j in range(k):
        acc = acc + p[:, j]
    return acc.to(h_RH.dtype)


def unpermute_backward_reference(
    g_TH: torch.Tensor, h_RH: torch.Tensor, w_Tk: torch.Tensor, inverse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_h [R, H], g_w [T, k]): what autograd gives through `unpermute_reference` for the
    gradient g [T, H] of its output, op for op: g in h's dtype, g_h = g w (rounded) put back
    in sorted order by index_add into zeros, g_w = the sum over H of the rounded g h."""
    t, k = w_Tk.shape
    g = g_TH.to(h_RH.dtype)[:, None, :]
    g_h_Tk = g * w_Tk.to(h_RH.dtype)[..., None]
    g_h = torch.zeros_like(h_RH).index_add_(0, inverse, g_h_Tk.reshape(t * k, -1))
    g_w = (g * h_RH.index_select(0, inverse).view(t, k, -1)).sum(-1)
    return g_h, g_w


def permute_backward_reference(
    g_RH: torch.Tensor, inverse: torch.Tensor, top_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """[T, H] in `dtype`: each token's k rows of g, each in `dtype`, summed in slot order in
    fp32 from +0, one rounding to `dtype`."""
    g_Tk = g_RH.index_select(0, inverse).view(-1, top_k, g_RH.shape[-1])
    acc = torch.zeros(g_Tk[:, 0].shape, dtype=torch.float32, device=g_RH.device)
    for j in range(top_k):
        acc = acc + g_Tk[:, j].to(dtype)
    return acc.to(dtype)


def unpermute_fits(h_RH: torch.Tensor, w_Tk: torch.Tensor) -> bool:
    """The kernels take bf16 h [R, H] (H <= 16384, last dim contiguous) and bf16 w [T, k]
    with R = T k, on one device."""
    return (
        h_RH.dtype == w_Tk.dtype == _BF16
        and h_RH.dim() == 2
        and w_Tk.dim() == 2
        and h_RH.shape[0] == w_Tk.numel()
        and 0 < h_RH.shape[1] <= _MAX_ROW
        and h_RH.stride(-1) == 1
        and h_RH.device == w_Tk.device
    )


def permute_backward_fits(g_RH: torch.Tensor, dtype: torch.dtype) -> bool:
    """The kernel takes g [R, H] in fp32 or bf16 with its last dim contiguous, for x in fp32
    or bf16."""
    return (
        g_RH.dim() == 2
        and g_RH.dtype in (torch.float32, _BF16)
        and dtype in (torch.float32, _BF16)
        and g_RH.stride(-1) == 1
    )


def unpermute(h_RH: torch.Tensor, w_Tk: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """`unpermute_reference`'s bytes in one launch (`unpermute_fits` inputs)."""
    from mxrl.kernels.triton_moe_train import unpermute_kernel

    t, k = w_Tk.shape
    hdim = h_RH.shape[1]
    out = torch.empty((t, hdim), dtype=_BF16, device=h_RH.device)
    if t:
        block = min(_BLOCK, _pow2(hdim))
        unpermute_kernel[(t, -(-hdim // block))](
            h_RH, w_Tk.contiguous(), inverse, out, h_RH.stride(0), out.stride(0), hdim,
            K=k, BLOCK=block, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def unpermute_backward(
    g_TH: torch.Tensor, h_RH: torch.Tensor, w_Tk: torch.Tensor, inverse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_h [R, H], g_w [T, k]) for the gradient g [T, H] of `unpermute`'s output: g_h the
    reference backward's bytes, g_w within `unpermute_weight_grad_bound` of its."""
    from mxrl.kernels.triton_moe_train import unpermute_backward_kernel

    t, k = w_Tk.shape
    hdim = h_RH.shape[1]
    g = g_TH if g_TH.stride(-1) == 1 else g_TH.contiguous()
    g_h = torch.empty_like(h_RH, memory_format=torch.contiguous_format)
    g_w = torch.empty((t, k), dtype=_BF16, device=h_RH.device)
    if t:
        block = _pow2(hdim)
        unpermute_backward_kernel[(t,)](
            g, h_RH, w_Tk.contiguous(), inverse, g_h, g_w,
            g.stride(0), h_RH.stride(0), g_h.stride(0), hdim,
            K=k, BLOCK=block, num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False,
        )  # fmt: skip
    return g_h, g_w


def unpermute_weight_grad_bound(g_TH: torch.Tensor, h_Tk: torch.Tensor) -> torch.Tensor:
    """A bound on |g_w - exact| for either sum order, [T, k]: the bf16 products p = bf16(g h)
    summed in fp32 in any order are within (H - 1) 2^-24 sum|p| of their exact sum (a sum of n
    terms in any order: (n - 1) u sum|p|, u = 2^-24, to first order), and the rounding to bf16
    adds half an ulp, at most 2^-9 |s| (u_bf16 = 2^-8, relative to the result), taken here on
    the exact sum plus the first term: the two results differ by at most twice that."""
    g = g_TH.to(_BF16).float()[:, None, :]
    p = (g * h_Tk.float()).to(_BF16).double()
    s = p.sum(-1).abs()
    reorder = (h_Tk.shape[-1] - 1) * 2.0**-24 * p.abs().sum(-1)
    return 2 * (reorder + 2.0**-8 * (s + reorder))


def permute_backward(
    g_RH: torch.Tensor, inverse: torch.Tensor, top_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """`permute_backward_reference`'s bytes in one launch (`permute_backward_fits` inputs)."""
    from mxrl.kernels.triton_moe_train import permute_backward_kernel

    hdim = g_RH.shape[1]
    t = g_RH.shape[0] // top_k
    out = torch.empty((t, hdim), dtype=dtype, device=g_RH.device)
    if t:
        block = min(_BLOCK, _pow2(hdim))
        permute_backward_kernel[(t, -(-hdim // block))](
            g_RH, inverse, out, g_RH.stride(0), out.stride(0), hdim,
            K=top_k, BLOCK=block, OUT_BF16=dtype == _BF16, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())
