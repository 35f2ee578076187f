"""Grouped block-FP8 GEMMs (routed experts), one launch for all experts: the Triton kernels behind
`mxrl.kernels.fp8_gemm.grouped_fp8_block_matmul` (forward; dgrad with w read transposed) and
`grouped_fp8_block_wgrad` (the weight gradient, grouped along the tokens).

Legend: R rows sorted by expert (expert e owns rows offsets[e]:offsets[e+1]), N / K a
projection's output / input features, E experts, KB = 128 (the block), BM / BN the tile.

    y[r, n] = sum over K blocks kb of  sx[r, kb] * sw[e, n // 128, kb] * sum_{k in kb} qx[r, k] qw[e, n, k]

with qx the 1x128 activation codes and qw the 128x128 weight codes (E4M3 bytes, fp32 decode
scales), exactly the contract's block-FP8 product (spec §5.4). Each K block's inner sum runs on
the tensor cores with the codes decoded to fp16 (every E4M3 value is an fp16: the products are
exact) and fp32 accumulation — or, FP8_MMA, on the FP8 MMA itself (`code_dot`) — then is
scaled and added in fp32: the promotion per 128-wide block DeepGEMM uses. It differs from the emulated fp32 GEMM (`dequantize(x) @ dequantize(w)^T`)
by summation order and where the scales multiply, within the bound the tests state.

Work split: program (n tile, slot) serves the slot-th expert that has rows (`find_group`, no
host sync), walking its rows in BM tiles; a row's result depends on that row alone (the MMA
reduces over K in an order fixed by the compiled tile shape), so the kernel is batch-invariant
for a fixed (BM, BN).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxrl.kernels.triton_gemm_decode import bf16_rne, e4m3_to_f16
from mxrl.kernels.triton_gemm_tiles import find_group, tile_dot

KB = 128


@triton.jit
def code_dot(acc, qa, qb, HW: tl.constexpr, FP8_MMA: tl.constexpr):
    """acc [BM, BN] += qa [BM, 128] @ qb [BN, 128]^T on E4M3 codes (uint8): on the FP8 tensor
    cores (FP8_MMA: Hopper's FP8 MMA, whose accumulation inside the 128-wide block keeps fewer
    than fp32's bits — the reason the caller promotes every block to fp32), or decoded to fp16
    (exact) on the fp16 MMA with fp32 accumulation."""
    if HW and FP8_MMA:
        a8 = qa.to(tl.float8e4nv, bitcast=True)
        b8 = qb.to(tl.float8e4nv, bitcast=True)
        return tl.dot(a8, tl.trans(b8), acc)
    return tile_dot(acc, e4m3_to_f16(qa, HW), e4m3_to_f16(qb, HW), HW, False)


@triton.jit(do_not_specialize=["E"])
def fp8_block_grouped_kernel(
    xq_ptr,  # uint8 [R, K]
    xs_ptr,  # fp32 [R, K/128]
    wq_ptr,  # uint8 [E, N, K] (or a transposed view: strides)
    ws_ptr,  # fp32 [E, N/128, K/128] (likewise)
    offs_ptr,  # int32 [E + 1]
    y_ptr,  # [R, N]
    xq_stride,
    xs_stride,
    wq_stride_e,
    wq_stride,
    wq_stride_k,
    ws_stride_e,
    ws_stride,
    ws_stride_k,
    y_stride,
    N,
    K,
    E,
    HW: tl.constexpr,
    OUT_BF16: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8_MMA: tl.constexpr,
):
    n_tile = tl.program_id(0)
    slot = tl.program_id(1)
    e, row_lo, row_hi = find_group(offs_ptr, slot, E, E_POW2)
    if row_hi > row_lo:
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = cols < N
        nb = (n_tile * BLOCK_N) // 128  # BLOCK_N divides 128: the tile lies in one weight block
        e64 = e.to(tl.int64)
        wq_base = wq_ptr + e64 * wq_stride_e
        ws_base = ws_ptr + e64 * ws_stride_e + nb * ws_stride
        kk = tl.arange(0, 128)
        for m0 in range(row_lo, row_hi, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            m_mask = rows < row_hi
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, 128):
                k_mask = (k0 + kk) < K
                x_off = rows[:, None].to(tl.int64) * xq_stride + (k0 + kk)[None, :]
                xq = tl.load(xq_ptr + x_off, mask=m_mask[:, None] & k_mask[None, :], other=0)
                w_off = (
                    cols[:, None].to(tl.int64) * wq_stride
                    + (k0 + kk)[None, :].to(tl.int64) * wq_stride_k
                )
                wq = tl.load(wq_base + w_off, mask=n_mask[:, None] & k_mask[None, :], other=0)
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                part = code_dot(part, xq, wq, HW, FP8_MMA)
                sx = tl.load(xs_ptr + rows.to(tl.int64) * xs_stride + k0 // 128, mask=m_mask)
                sw = tl.load(ws_base + (k0 // 128) * ws_stride_k)
                acc += part * (sx[:, None] * sw)
            y_off = rows[:, None].to(tl.int64) * y_stride + cols[None, :]
            if OUT_BF16:  # round to nearest even (the interpreter's cast truncates)
                out = bf16_rne(acc)
            else:
                out = acc.to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + y_off, out, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["E"])
def fp8_block_kgrouped_kernel(
    aq_ptr,  # uint8 [N, R]: dy^T codes, 1x128 blocks along R
    as_ptr,  # fp32 [N, R/128]
    bq_ptr,  # uint8 [K, R]: x^T codes, 1x128 blocks along R
    bs_ptr,  # fp32 [K, R/128]
    offs_ptr,  # int32 [E + 1]: multiples of 128
    y_ptr,  # fp32 [E, N, K]
    aq_stride,
    as_stride,
    bq_stride,
    bs_stride,
    y_stride_e,
    y_stride,
    N,
    K,
    E,
    E_PER_GROUP,
    HW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP8_MMA: tl.constexpr,
    E_POW2: tl.constexpr,
):
    """dW[e] = sum over the 128-row blocks rb of expert e of
    sa[:, rb] sb[:, rb]^T * (qa[:, rb] @ qb[:, rb]^T): the routed experts' weight gradient, a
    GEMM grouped along its reduction (each expert reduces over its own rows).

    Program (N tile, K tile, group) streams the 128-row blocks of a run of E_PER_GROUP experts
    in one loop — one pipelined stream of loads however few tokens each expert has — and stores
    an expert's tile when its last block is summed (a masked store, then the accumulator
    restarts). Experts of the group without tokens get zeros."""
    n_tile = tl.program_id(0)
    k_tile = tl.program_id(1)
    g = tl.program_id(2)
    e_lo = g * E_PER_GROUP
    e_hi = tl.minimum(e_lo + E_PER_GROUP, E)
    ns = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = ns < N
    k_mask = ks < K
    tile_mask = n_mask[:, None] & k_mask[None, :]
    tile_off = ns[:, None].to(tl.int64) * y_stride + ks[None, :]
    zero = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for ee in range(e_lo, e_hi):  # experts without tokens: a zero gradient
        empty = tl.load(offs_ptr + ee + 1) == tl.load(offs_ptr + ee)
        ee64 = ee + tl.zeros([], dtype=tl.int64)  # the interpreter's loop index is an int
        tl.store(y_ptr + ee64 * y_stride_e + tile_off, zero, mask=tile_mask & empty)
    idx = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + 1 + idx, mask=idx < E, other=2147483647)  # each expert's end row
    rr = tl.arange(0, 128)
    acc = zero
    # the loop runs over block indices, so that r0 is a known multiple of 128: the codes load
    # as 16-byte vectors (a loop from a loaded bound loaded them byte by byte, unpipelined)
    for blk in range(tl.load(offs_ptr + e_lo) // 128, tl.load(offs_ptr + e_hi) // 128):
        r0 = blk * 128
        a_off = ns[:, None].to(tl.int64) * aq_stride + (r0 + rr)[None, :]
        qa = tl.load(aq_ptr + a_off, mask=n_mask[:, None], other=0)
        b_off = ks[:, None].to(tl.int64) * bq_stride + (r0 + rr)[None, :]
        qb = tl.load(bq_ptr + b_off, mask=k_mask[:, None], other=0)
        part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        part = code_dot(part, qa, qb, HW, FP8_MMA)
        sa = tl.load(as_ptr + ns.to(tl.int64) * as_stride + r0 // 128, mask=n_mask, other=0.0)
        sb = tl.load(bs_ptr + ks.to(tl.int64) * bs_stride + r0 // 128, mask=k_mask, other=0.0)
        acc += part * (sa[:, None] * sb[None, :])
        e = tl.sum((ends <= r0).to(tl.int32), 0)  # the expert whose rows hold this block
        last = tl.sum(tl.where(idx == e, ends, 0), 0) == r0 + 128
        tl.store(y_ptr + e.to(tl.int64) * y_stride_e + tile_off, acc, mask=tile_mask & last)
        acc = tl.where(last, 0.0, acc)
