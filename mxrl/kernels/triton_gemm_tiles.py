"""Tile-level device functions of the low-bit GEMM (`triton_gemm.py`, whose docstring has the
semantics and the exactness argument): loading code and scale tiles, the dots (tensor cores,
CUDA-core fma, IEEE fp32, MXFP8 per-scale-block), the scaled and rounded store of y, and the
grouped launch's expert lookup; on the host, the split-K counters the kernel keeps zero.

This module imports triton: import it only where triton is available (the triton backend).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxrl.kernels.triton_codecs import e8m0_to_f32
from mxrl.kernels.triton_gemm_decode import bf16_rne, e4m3_to_f16


@triton.jit
def mxfp8_block_dots(
    acc,
    xq_ptr,
    xs_ptr,
    xq_stride,
    xs_stride,
    rows,
    m_mask,
    wq_base,
    ws_base,
    wq_stride,
    ws_stride,
    cols,
    n_mask,
    k0,
    k_hi,
    HW: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    MASK_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """MXFP8, small M: one dot per 32-element scale block on the E4M3 values themselves (fp16,
    exact), its fp32 sum times 2^(kx[m] + kw[n]) (exact) added to acc. Decoding costs one cvt per
    two weights instead of a multiply and two conversions per weight; the output-tile scaling
    costs BM * BN per 32 K, which is cheap while BM <= 32 (the launcher's condition)."""
    NB: tl.constexpr = BK // 32
    _, xs = load_codes(
        xq_ptr, xs_ptr, xq_stride, xs_stride, rows, m_mask, k0, k_hi, 1, 32, True, EVEN_K, BK
    )  # fmt: skip
    _, ws = load_codes(
        wq_base, ws_base, wq_stride, ws_stride, cols, n_mask, k0, k_hi, 1, 32, MASK_N, EVEN_K, BK
    )  # fmt: skip
    sx_all = e8m0_to_f32(xs.to(tl.int32))  # [BM, NB]
    sw_all = e8m0_to_f32(ws.to(tl.int32))  # [BN, NB]
    blk = tl.arange(0, NB)
    for j in tl.static_range(NB):
        kj = k0 + 32 * j
        xq, _ = load_codes(
            xq_ptr, xs_ptr, xq_stride, xs_stride, rows, m_mask, kj, k_hi, 1, 32, True, EVEN_K, 32
        )
        wq, _ = load_codes(
            wq_base, ws_base, wq_stride, ws_stride, cols, n_mask,
            kj, k_hi, 1, 32, MASK_N, EVEN_K, 32,
        )  # fmt: skip
        zero = tl.zeros([BM, BN], dtype=tl.float32)
        part = tile_dot(zero, e4m3_to_f16(xq, HW), e4m3_to_f16(wq, HW), HW, DOT_IEEE)
        sx = tl.sum(tl.where(blk[None, :] == j, sx_all, 0.0), axis=1)  # column j (exact)
        sw = tl.sum(tl.where(blk[None, :] == j, sw_all, 0.0), axis=1)
        acc = acc + part * (sx[:, None] * sw[None, :])
    return acc


@triton.jit
def load_codes(
    q_base,
    s_base,
    q_stride,
    s_stride,
    rows,
    row_mask,
    k0,
    k_hi,
    EPB: tl.constexpr,
    SB: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BK: tl.constexpr,
):
    """Codes [R, BK/EPB] and scale bytes [R, BK/SB] of `rows` (row strides q_stride / s_stride
    bytes), columns k0 .. k0+BK; rows outside row_mask and columns >= k_hi read as 0 (masked
    only where the launcher could not prove the tile in bounds: MASK_ROWS, EVEN_K)."""
    qc = k0 // EPB + tl.arange(0, BK // EPB)
    sc = k0 // SB + tl.arange(0, BK // SB)
    q_ptrs = q_base + rows[:, None] * q_stride + qc[None, :]
    s_ptrs = s_base + rows[:, None] * s_stride + sc[None, :]
    if EVEN_K:
        if MASK_ROWS:
            q = tl.load(q_ptrs, mask=row_mask[:, None], other=0)
            s = tl.load(s_ptrs, mask=row_mask[:, None], other=0)
        else:
            q = tl.load(q_ptrs)
            s = tl.load(s_ptrs)
    else:
        q = tl.load(q_ptrs, mask=row_mask[:, None] & (qc < k_hi // EPB)[None, :], other=0)
        s = tl.load(s_ptrs, mask=row_mask[:, None] & (sc < k_hi // SB)[None, :], other=0)
    return q, s


@triton.jit
def fma_dot(acc, xv, wv):
    """acc [BM, BN] += xv [BM, BK] @ wv [BN, BK]^T on the CUDA cores, one row of x at a time:
    fp32 products (exact) summed along K, the weight tile staying in its load layout."""
    BM: tl.constexpr = xv.shape[0]
    w32 = wv.to(tl.float32)
    x32 = xv.to(tl.float32)
    if BM == 1:
        return acc + tl.sum(w32 * x32, axis=1)[None, :]
    else:
        r = tl.arange(0, BM)
        for m in tl.static_range(BM):
            xm = tl.sum(tl.where(r[:, None] == m, x32, 0.0), axis=0)  # row m (one nonzero term)
            part = tl.sum(w32 * xm[None, :], axis=1)
            acc = tl.where(r[:, None] == m, acc + part[None, :], acc)
        return acc


@triton.jit
def tile_dot(acc, xv, wv, HW: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_FMA: tl.constexpr = False):
    """acc [BM, BN] += xv [BM, BK] @ wv [BN, BK]^T, products exact (module docstring).

    xv, wv: fp16 (NVFP4 halves) or fp32 (MXFP8, fed to the tensor cores as bf16). DOT_FMA: on
    the CUDA cores, fp32 products summed along K per output (small BM: no tensor-core tile
    padding M to 16, and the decoded weights never leave registers)."""
    if DOT_FMA:
        return fma_dot(acc, xv, wv)
    elif DOT_IEEE:
        return tl.dot(xv.to(tl.float32), tl.trans(wv.to(tl.float32)), acc, input_precision="ieee")
    elif HW:
        if xv.dtype == tl.float16:
            return tl.dot(xv, tl.trans(wv), acc)
        else:
            return tl.dot(xv.to(tl.bfloat16), tl.trans(wv.to(tl.bfloat16)), acc)
    else:
        # the interpreter's bf16 dot multiplies raw bit patterns: round-trip, then fp32
        if xv.dtype == tl.float16:
            xb = xv.to(tl.float32)
            wb = wv.to(tl.float32)
        else:
            xb = xv.to(tl.bfloat16).to(tl.float32)
            wb = wv.to(tl.bfloat16).to(tl.float32)
        return tl.dot(xb, tl.trans(wb), acc, input_precision="ieee")


@triton.jit
def store_y(
    acc,
    rows,
    m_mask,
    cols,
    n_mask,
    y_ptr,
    N,
    xgs_ptr,
    xgs_stride,
    wgs_base,
    wgs_stride_n,
    HAS_GS: tl.constexpr,
    HW: tl.constexpr,
):
    """y = acc * fl(s_x * s_w), s = fl(1 / S_enc), cast (RNE) to y's dtype."""
    if HAS_GS:
        sx_enc = tl.load(xgs_ptr + rows * xgs_stride, mask=m_mask, other=1.0)
        sw_enc = tl.load(wgs_base + cols * wgs_stride_n, mask=n_mask, other=1.0)
        sx = tl.div_rn(tl.full(sx_enc.shape, 1.0, tl.float32), sx_enc)
        sw = tl.div_rn(tl.full(sw_enc.shape, 1.0, tl.float32), sw_enc)
        acc = acc * (sx[:, None] * sw[None, :])
    out_ty = y_ptr.dtype.element_ty
    if out_ty == tl.bfloat16 and not HW:
        acc = bf16_rne(acc)  # the interpreter's fp32 -> bf16 cast truncates
    elif out_ty != tl.float32:
        acc = acc.to(out_ty, fp_downcast_rounding="rtne")
    mask = m_mask[:, None] & n_mask[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def find_group(offs_ptr, slot, E, E_POW2: tl.constexpr):
    """(expert, first row, end row) of the slot-th expert with rows; (0, 0, 0) past the last."""
    idx = tl.arange(0, E_POW2)
    valid = idx < E
    lo = tl.load(offs_ptr + idx, mask=valid, other=0).to(tl.int32)
    hi = tl.load(offs_ptr + idx + 1, mask=valid, other=0).to(tl.int32)
    active = ((hi > lo) & valid).to(tl.int32)
    rank = tl.cumsum(active, 0) - active  # number of active experts before this one
    sel = (active == 1) & (rank == slot)
    e = tl.sum(tl.where(sel, idx, 0), 0)
    row_lo = tl.sum(tl.where(sel, lo, 0), 0)
    row_hi = tl.sum(tl.where(sel, hi, 0), 0)
    return e, row_lo, row_hi


# Self-resetting split-K counters, one buffer per device, never freed (a CUDA graph that captured
# one keeps using it). Launches sharing a device's counters must be stream-ordered: concurrent
# split-K GEMMs on two streams of one device are not supported.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}
_MIN_COUNTERS = 1 << 16


def split_k_counters(device: torch.device, needed: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least `needed` counters on `device` (kept zero by the kernel)."""
    pool = _COUNTERS.setdefault(torch.device(device), [])
    if not pool or pool[-1].numel() < needed:
        size = max(_MIN_COUNTERS, triton.next_power_of_2(needed))
        pool.append(torch.zeros(size, dtype=torch.int32, device=device))
    return pool[-1]
