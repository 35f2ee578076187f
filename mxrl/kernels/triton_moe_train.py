"""Triton kernels of the trainer's MoE permutation around its grouped GEMMs (launchers and
references: mxrl/kernels/moe_train.py). Each program reads one token's k rows by the layout's
`inverse` (token t's slot j is sorted row inverse[t k + j]) and adds them in slot order into an
fp32 accumulator that starts at +0, the order the references' loops fix.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxrl.kernels.triton_gemm_decode import bf16_rne


@triton.jit
def unpermute_kernel(
    h_ptr,  # bf16 [R, H]: the down projection's rows, sorted by expert
    w_ptr,  # bf16 [T, K]: each (token, slot)'s routing weight
    inv_ptr,  # int64 [T * K]: the sorted row of (token, slot)
    out_ptr,  # bf16 [T, H]
    stride_h,
    stride_o,
    H,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t] = bf16(sum_j bf16(h[inverse[t K + j]] * w[t, j])), j ascending, fp32 sums (the
    product of two bf16 is exact in fp32: one rounding each)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(K):
        row = tl.load(inv_ptr + t * K + j)
        h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc = acc + bf16_rne(h * w).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, bf16_rne(acc), mask=mask)


@triton.jit
def unpermute_backward_kernel(
    g_ptr,  # [T, H]: the gradient of the combined output (bf16 or fp32)
    h_ptr,  # bf16 [R, H]
    w_ptr,  # bf16 [T, K]
    inv_ptr,  # int64 [T * K]
    gh_ptr,  # bf16 [R, H]: the gradient of h
    gw_ptr,  # bf16 [T, K]: the gradient of w
    stride_g,
    stride_h,
    stride_gh,
    H,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One token's whole row: g in bf16 (the output's gradient as autograd hands it to the
    bf16 product), then per slot g_h[row] = bf16(g w) + 0 (autograd's index_add into zeros:
    -0 becomes +0) and g_w[t, j] = bf16(sum over H of bf16(g h[row])) in this kernel's order."""
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    g = tl.load(g_ptr + t.to(tl.int64) * stride_g + cols, mask=mask, other=0.0)
    g = bf16_rne(g.to(tl.float32)).to(tl.float32)
    for j in tl.static_range(K):
        row = tl.load(inv_ptr + t * K + j)
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        gh = bf16_rne(g * w).to(tl.float32) + 0.0
        tl.store(gh_ptr + row * stride_gh + cols, bf16_rne(gh), mask=mask)
        h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        gw = tl.sum(bf16_rne(g * h).to(tl.float32), axis=0)
        tl.store(gw_ptr + t * K + j, bf16_rne(gw))


@triton.jit
def permute_backward_kernel(
    g_ptr,  # [R, H]: the gradient of the gathered rows (bf16 or fp32)
    inv_ptr,  # int64 [T * K]
    out_ptr,  # [T, H]: the gradient of x (fp32 or bf16)
    stride_g,
    stride_o,
    H,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """out[t] = sum_j x_dtype(g[inverse[t K + j]]), j ascending, fp32 sums, one rounding to x's
    dtype."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(K):
        row = tl.load(inv_ptr + t * K + j)
        v = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        if OUT_BF16:
            v = bf16_rne(v).to(tl.float32)
        acc = acc + v
    if OUT_BF16:
        out = bf16_rne(acc)
    else:
        out = acc
    tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, out, mask=mask)
