"""Row-wise Triton kernels of the engine's decode step: RMSNorm and the routed experts' combine.
Each program computes one row from that row alone, in an order fixed by the kernel (batch
invariance by construction). References and launchers: mxrl/kernels/rowwise.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxrl.kernels.triton_gemm_decode import bf16_rne


@triton.jit
def _round(v, dtype: tl.constexpr, IS_BF16: tl.constexpr):
    """fp32 -> dtype, round to nearest even (on the bit pattern for bf16: the interpreter's
    cast truncates, the GPU's rounds; both then give the same bytes)."""
    if IS_BF16:
        return bf16_rne(v)
    return v.to(dtype)


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [R, H]
    w_ptr,  # [H]
    out_ptr,  # [R, H]
    stride_x,
    stride_o,
    H,
    eps,
    BLOCK: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # IEEE division and square root (plain `/` lowers to the approximate div.full.f32)
    ss = tl.sum(x * x, axis=0)
    mean = tl.div_rn(ss, tl.full(ss.shape, H, tl.float32))
    root = tl.sqrt_rn(mean + eps)
    r = tl.div_rn(tl.full(root.shape, 1.0, tl.float32), root)
    dtype = out_ptr.dtype.element_ty
    y = _round(x * r, dtype, IS_BF16)  # the module's cast back to the input dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = _round(w.to(tl.float32) * y.to(tl.float32), dtype, IS_BF16)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, out, mask=mask)


@triton.jit
def moe_combine_kernel(
    h_ptr,  # [rows, H]: expert outputs, rows sorted by expert
    w_ptr,  # [rows]: the routing weight of each row, in h's dtype
    row_of_ptr,  # int64 [T, k]: the row of token t's j-th expert (ascending expert order)
    out_ptr,  # [T, H]
    stride_h,
    stride_o,
    H,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    """out[t] = sum_j round(h[row_of[t, j]] * w[row]) in h's dtype, j ascending, each product
    and each partial sum rounded to h's dtype — the eager loop's operations, fused."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), tl.float32).to(dtype)
    for j in tl.static_range(K):
        row = tl.load(row_of_ptr + t * K + j)
        h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
        w = tl.load(w_ptr + row)
        p = _round(h.to(tl.float32) * w.to(tl.float32), dtype, IS_BF16)
        acc = _round(acc.to(tl.float32) + p.to(tl.float32), dtype, IS_BF16)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, acc, mask=mask)
