"""MXFP8 quantizer (Triton): row-wise and column-wise copies from one read of the input.

Matches `mxrl.formats.mxfp8.quantize_mxfp8` with scale_mode="rceil" byte for byte:
  code = ceil_e8m0(amax * fl(1/448));  q = E4M3_satfinite(x * 2^(127 - code))   (spec §2.2-§2.3)
with q saturating to ±240 instead of ±448 at code 247 (2^120), so that q x 2^120 is finite
(`e4m3_limit`; docs/formats.md, "The top of the fp32 range").
row-wise: 1x32 blocks along K, scales [M, K/32]; column-wise: 32x1 blocks along M, scales
[M/32, K]; both data tensors keep x's [M, K] layout (TE, spec §2.1).
Non-finite inputs as the reference: amax over the finite elements (`finite_amax`), NaN/±Inf
elements -> 0x7F (`e4m3_encode_masked`), in both copies.

Legend: x_MK the input viewed as [M, K] (K contiguous); one program quantizes a
[BLOCK_M, BLOCK_K] tile, BLOCK_M a multiple of 32 when the column-wise copy is produced, so that
one load serves both copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxrl.kernels.backend import launcher
from mxrl.kernels.triton_codecs import (
    RCP_448,
    ceil_e8m0,
    e4m3_decode,
    e4m3_encode_limited,
    e4m3_limit,
    e8m0_reciprocal,
    e8m0_to_f32,
    finite_amax,
    is_finite,
    load_tile,
    store_bf16,
    store_error_sums,
    store_row_scales,
    store_tile,
)

MX_BLOCK: tl.constexpr = tl.constexpr(32)

# (BLOCK_M, BLOCK_K, num_warps); `benchmarks/quantize.py --sweep` measures alternatives.
DEFAULT_CONFIG = {"BLOCK_M": 32, "BLOCK_K": 256, "num_warps": 4}


@triton.jit(do_not_specialize=["M"])  # M only bounds masks: one compile for all row counts
def _mxfp8_kernel(
    x_ptr,
    q_row_ptr,
    s_row_ptr,
    q_col_ptr,
    s_col_ptr,
    sums_ptr,
    src_ptr,
    M,
    K,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    HW: tl.constexpr,
    INDEX_64: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_QDQ: tl.constexpr,
    COL_QDQ: tl.constexpr,
    SUMS: tl.constexpr,
    GATHER: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    if INDEX_64:
        rows = rows.to(tl.int64)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    offs = rows[:, None] * K + cols[None, :]
    if GATHER:  # tile row i is x's row src[i] (R rows), or zeros where src[i] < 0 (padding)
        src = tl.load(src_ptr + rows, mask=rows < M, other=-1)
        if INDEX_64:
            src = src.to(tl.int64)
        x_rows = tl.where(src >= 0, src, 0)
        x_rows_valid = src >= 0
        x_mask = x_rows_valid[:, None] & (cols < K)[None, :]
        x_offs = x_rows[:, None] * K + cols[None, :]
        x = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
    else:
        x_rows, x_rows_valid, x_mask, x_offs = rows, rows < M, mask, offs
        x = load_tile(x_ptr + offs, mask, EVEN).to(tl.float32)
    finite = is_finite(x)  # the amaxes' compare, reused by the E4M3 encodes (both copies)

    if ROWWISE:  # stored at x's rows
        NUM_KB: tl.constexpr = BLOCK_K // MX_BLOCK
        amax = finite_amax(tl.reshape(x, [BLOCK_M, NUM_KB, MX_BLOCK]), 2)
        code = ceil_e8m0(amax * RCP_448)
        scaled = tl.reshape(x, [BLOCK_M, NUM_KB, MX_BLOCK]) * e8m0_reciprocal(code)[:, :, None]
        limit = tl.broadcast_to(e4m3_limit(code)[:, :, None], [BLOCK_M, NUM_KB, MX_BLOCK])
        q = e4m3_encode_limited(
            tl.reshape(scaled, [BLOCK_M, BLOCK_K]),
            tl.reshape(limit, [BLOCK_M, BLOCK_K]),
            finite,
            HW,
        )
        if ROW_QDQ:  # the dequantized values in bf16 (exact), no codes or scales
            deq = tl.reshape(e4m3_decode(q.to(tl.int32)), [BLOCK_M, NUM_KB, MX_BLOCK])
            deq = deq * e8m0_to_f32(code)[:, :, None]
            store_bf16(q_row_ptr + x_offs, tl.reshape(deq, [BLOCK_M, BLOCK_K]), x_mask, HW)
        else:
            even_rows: tl.constexpr = EVEN and not GATHER
            store_tile(q_row_ptr + x_offs, q, x_mask, even_rows)
            s_codes = code.to(tl.uint8)
            store_row_scales(
                s_row_ptr, s_codes, x_rows, x_rows_valid, pid_k * NUM_KB, K // MX_BLOCK, NUM_KB,
                even_rows,
            )  # fmt: skip
            if SUMS:  # the row-wise copy's (the launcher asks for no column-wise one)
                value = tl.reshape(e4m3_decode(q.to(tl.int32)), [BLOCK_M, NUM_KB, MX_BLOCK])
                value = tl.reshape(value * e8m0_to_f32(code)[:, :, None], [BLOCK_M, BLOCK_K])
                part = pid_m * tl.num_programs(1) + pid_k
                store_error_sums(sums_ptr, part, x, value, finite)

    if COLWISE:  # stored at the tile's own rows (GATHER: the padded layout, zeros included)
        NUM_MB: tl.constexpr = BLOCK_M // MX_BLOCK
        amax_c = finite_amax(tl.reshape(x, [NUM_MB, MX_BLOCK, BLOCK_K]), 1)
        code_c = ceil_e8m0(amax_c * RCP_448)
        scaled_c = tl.reshape(x, [NUM_MB, MX_BLOCK, BLOCK_K]) * e8m0_reciprocal(code_c)[:, None, :]
        limit_c = tl.broadcast_to(e4m3_limit(code_c)[:, None, :], [NUM_MB, MX_BLOCK, BLOCK_K])
        q_c = e4m3_encode_limited(
            tl.reshape(scaled_c, [BLOCK_M, BLOCK_K]),
            tl.reshape(limit_c, [BLOCK_M, BLOCK_K]),
            finite,
            HW,
        )
        if COL_QDQ:
            deq_c = tl.reshape(e4m3_decode(q_c.to(tl.int32)), [NUM_MB, MX_BLOCK, BLOCK_K])
            deq_c = deq_c * e8m0_to_f32(code_c)[:, None, :]
            store_bf16(q_col_ptr + offs, tl.reshape(deq_c, [BLOCK_M, BLOCK_K]), mask, HW)
        else:
            store_tile(q_col_ptr + offs, q_c, mask, EVEN)
            mb = pid_m * NUM_MB + tl.arange(0, NUM_MB)
            if INDEX_64:
                mb = mb.to(tl.int64)
            sc_mask = (mb < M // MX_BLOCK)[:, None] & (cols < K)[None, :]
            sc_ptrs = s_col_ptr + mb[:, None] * K + cols[None, :]
            store_tile(sc_ptrs, code_c.to(tl.uint8), sc_mask, EVEN)


def launch_mxfp8(
    x_MK: torch.Tensor,
    rowwise: bool,
    colwise: bool,
    *,
    hw: bool | None = None,
    config: dict | None = None,
    qdq: bool = False,
    sums: bool = False,
    col_qdq: bool | None = None,
    gather: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """(q_row [M, K] u8, s_row [M, K/32] u8, q_col [M, K] u8, s_col [M/32, K] u8); a copy
    not asked for comes back as an empty tensor. x_MK: contiguous 2-D fp32/bf16/fp16.
    qdq: each copy's dequantized values in bf16 [M, K] instead of its codes, and no scales
    (empty): `dequantize(quantize(x)).to(bfloat16)` in one pass; col_qdq (default: qdq) the
    column-wise copy's choice alone. sums (the row-wise copy alone): also each program's fp32
    (sum x^2, sum (x - dequantized)^2, non-finite count) over its tile (`store_error_sums`),
    parts [cdiv(M, BLOCK_M), programs along K, 3], as a fifth output.
    gather: int32 [P] (P a multiple of 32): the column-wise copy is that of the [P, K] tensor
    whose row i is x's row gather[i], or zeros where gather[i] < 0 (MXFP8's quantized
    backward's padded layout, `mxrl.nn.paths.grouped.PaddedLayout`), [P, K] and [P/32, K];
    the row-wise copy stays x's [M, K] (each of x's rows must appear once in gather)."""
    assert x_MK.dim() == 2 and x_MK.is_contiguous(), (x_MK.shape, x_MK.stride())
    assert rowwise or colwise
    col_qdq = qdq if col_qdq is None else col_qdq
    assert not sums or (rowwise and not colwise and not qdq), (rowwise, colwise, qdq)
    assert gather is None or not sums
    m, k = x_MK.shape
    p = m if gather is None else gather.shape[0]
    assert k % 32 == 0 and (not colwise or p % 32 == 0), (m, p, k)
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    block_m, block_k = cfg["BLOCK_M"], cfg["BLOCK_K"]
    assert block_m % 32 == 0 and block_k % 32 == 0, cfg
    dev = x_MK.device
    hw = x_MK.is_cuda if hw is None else hw

    def out(shape, wanted, dtype=torch.uint8):
        return torch.empty(shape if wanted else (0,), dtype=dtype, device=dev)

    row_data = torch.bfloat16 if qdq else torch.uint8
    col_data = torch.bfloat16 if col_qdq else torch.uint8
    q_row, s_row = out((m, k), rowwise, row_data), out((m, k // 32), rowwise and not qdq)
    q_col, s_col = out((p, k), colwise, col_data), out((p // 32, k), colwise and not col_qdq)
    grid = (triton.cdiv(p, block_m), triton.cdiv(k, block_k))
    outputs = (q_row, s_row, q_col, s_col)
    if sums:  # (no allocation otherwise: the training step calls this ~170 times a step)
        outputs += (torch.empty((*grid, 3), dtype=torch.float32, device=dev),)
    if p == 0 or k == 0:
        return outputs
    # A copy not asked for is never stored to (constexpr branch); its pointer is a dummy.
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)

    def target(t, wanted, bf16):  # not HW, the bf16 store writes the bits into an int16 view
        return dummy if not wanted else (t.view(torch.int16) if bf16 and not hw else t)

    launcher(_mxfp8_kernel, x_MK)[grid](
        x_MK,
        target(q_row, rowwise, qdq),
        target(s_row, rowwise and not qdq, False),
        target(q_col, colwise, col_qdq),
        target(s_col, colwise and not col_qdq, False),
        outputs[4] if sums else dummy,
        dummy if gather is None else gather,
        p,
        k,
        ROWWISE=rowwise,
        COLWISE=colwise,
        HW=hw,
        INDEX_64=max(x_MK.numel(), p * k) >= 2**31,
        EVEN=p % block_m == 0 and k % block_k == 0,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        ROW_QDQ=qdq,
        COL_QDQ=col_qdq,
        SUMS=sums,
        GATHER=gather is not None,
        num_warps=cfg["num_warps"],
    )
    return outputs
