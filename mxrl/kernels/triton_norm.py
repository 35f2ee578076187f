"""Triton kernels of the trainer's fused RMSNorm: the forward (the engine's statistics, the
1/rms saved), the backward (dx per row, dweight as per-program fp32 partial sums) and the fixed-
order sum of those partials. Launchers, references and the bounds: mxrl/kernels/norm_train.py.

Every row is reduced from that row alone, in a layout fixed by H (never by the batch), so a
row's y, 1/rms and dx do not depend on the other rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxrl.kernels.triton_rowwise import rms_rstd, round_to


@triton.jit
def rms_norm_fwd_kernel(
    x_ptr,  # [R, H]
    w_ptr,  # [H]
    out_ptr,  # [R, H], the promoted dtype of x and w
    rstd_ptr,  # fp32 [R]
    stride_x,
    stride_o,
    H,
    eps,
    BLOCK: tl.constexpr,
    X_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """mxrl.kernels.triton_rowwise.rms_norm_kernel's operations (where x, w and out share a
    dtype, the same bytes), the cast back to x's dtype kept apart from the output's, and the
    1/rms stored for the backward."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = rms_rstd(x, H, eps)
    tl.store(rstd_ptr + row, r)
    y = round_to(x * r, x_ptr.dtype.element_ty, X_BF16)  # the module's cast back to x's dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = round_to(w.to(tl.float32) * y.to(tl.float32), out_ptr.dtype.element_ty, OUT_BF16)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, out, mask=mask)


@triton.jit
def rms_norm_bwd_kernel(
    x_ptr,  # [R, H]
    w_ptr,  # [H]
    g_ptr,  # [R, H]: the gradient of the output
    rstd_ptr,  # fp32 [R]: the forward's 1/rms
    dx_ptr,  # [R, H], x's dtype
    dw_part_ptr,  # fp32 [programs, H]: this program's rows' sum of g * y
    R,
    H,
    rows_per_program,  # a multiple of BLOCK_R
    stride_x,
    stride_g,
    stride_dx,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
    X_BF16: tl.constexpr,
):
    """dx = r (g w - xhat mean(g w xhat)), xhat = x r, for BLOCK_R rows at a time; the rows'
    g * y (y = xhat cast to x's dtype, the forward's bytes) summed into one fp32 partial."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < H
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK), tl.float32)
    first = pid * rows_per_program
    end = tl.minimum(first + rows_per_program, R)
    for start in range(first, end, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        rmask = rows < end
        m = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows64 * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
        r = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)[:, None]
        xhat = x * r
        dxhat = g * w[None, :]
        s = tl.sum(dxhat * xhat, axis=1)
        c = tl.div_rn(s, tl.full(s.shape, H, tl.float32))[:, None]
        dx = round_to((dxhat - xhat * c) * r, dx_ptr.dtype.element_ty, X_BF16)
        tl.store(dx_ptr + rows64 * stride_dx + cols[None, :], dx, mask=m)
        y = round_to(xhat, x_ptr.dtype.element_ty, X_BF16).to(tl.float32)
        acc += g * y  # masked rows and columns add zeros
    tl.store(dw_part_ptr + pid.to(tl.int64) * H + cols, tl.sum(acc, axis=0), mask=cmask)


@triton.jit
def sum_partials_kernel(
    part_ptr,  # fp32 [P, H]
    out_ptr,  # [H]
    P,
    H,
    BLOCK: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """out = sum of the P partials, in ascending order, rounded once to out's dtype."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for p in range(P):
        acc += tl.load(part_ptr + p * H + cols, mask=mask, other=0.0)
    tl.store(out_ptr + cols, round_to(acc, out_ptr.dtype.element_ty, OUT_BF16), mask=mask)
