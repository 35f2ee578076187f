"""NVFP4 quantizer (Triton): per-token fused, per-tensor (global amax pass + quantize pass), or
with a caller's global amax. Matches `mxrl.formats.nvfp4.quantize_nvfp4` (scale_mode="te") byte
for byte, in TransformerEngine's operation order (spec §3.2-§3.4):
  S_enc = fl(2688 / amax) (0/Inf amax -> 1, cap FLT_MAX);  S_dec = fl(1 / S_enc)
  t     = fl(b_amax * fl(S_enc * fl(1/6)));  s = E4M3_satfinite(min(t, FLT_MAX))
  enc   = min(fl(1 / fl(s * S_dec)), FLT_MAX);  q = E2M1_satfinite(fl(x * enc))
FOUR_OVER_SIX (`scale_mode="4over6"`, docs/formats.md "NVFP4 4over6"): a second candidate per
block with s_enc_4 = S_enc * 0.25 in place of fl(S_enc * fl(1/6)), and per block the one whose
squared error in the encoded domain is lower (ties: 6), as `nvfp4._four_over_six`:
  u = fl(x * S_enc);  d = fl(e2m1 * s - u);  err = pairwise tree sum of fl(d * d) over the 16
(adjacent pairs first; NaN/Inf elements count d = 0), the squares and u through `mul_rn`.
Outputs: packed E2M1 [M, K/2] (even element in the low nibble), E4M3 block scales [M, K/16],
S_enc per row [M] (per token) or one fp32 (per tensor).
Non-finite inputs as the reference: every amax (block, row, tensor) is over the finite elements
(`finite_amax`, `finite_abs`), and a 16-block holding NaN/±Inf stores scale 0x7F (E4M3 NaN), its
element codes computed with the finite scale as for any block (NaN -> 0x7, ±Inf -> ±6).

Legend: x_MK the input viewed as [M, K]; one program owns ROWS whole rows. A row's amax must be
known before its first block is scaled: when K fits one tile (BLOCK_K >= K) the row stays in
registers (one read of x); otherwise the program reads its rows twice (the second read mostly
from L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxrl.kernels.backend import launcher
from mxrl.kernels.triton_codecs import (
    E4M3_NAN_CODE,
    FLT_MAX,
    RCP_6,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_decode_nonneg,
    e4m3_encode,
    finite_amax,
    is_finite,
    load_tile,
    mul_rn,
    nvfp4_encode_scale,
    store_row_scales,
    store_tile,
    tile_error_sums,
)
from mxrl.kernels.triton_nvfp4_scale import launch_encode_scale

NV_BLOCK: tl.constexpr = tl.constexpr(16)
GS_NONE: tl.constexpr = tl.constexpr(0)
GS_PER_ROW: tl.constexpr = tl.constexpr(1)
GS_SCALAR: tl.constexpr = tl.constexpr(2)

# Rows in registers up to this many elements per program; larger K loops over the row twice.
DEFAULT_CONFIG = {"TILE_ELEMS": 8192, "LOOP_BLOCK_K": 4096, "num_warps": 4}


@triton.jit
def _block_amax(x, ROWS, BLOCK_K):
    return finite_amax(tl.reshape(x, [ROWS, BLOCK_K // NV_BLOCK, NV_BLOCK]), 2)


@triton.jit
def _block_scale(b_amax, s_enc_per, s_dec, HW):
    """TE order (§3.3) for every block: (E4M3 scale byte, its value, element multiplier enc);
    s_enc_per = fl(S_enc * fl(1/6)) maps the block amax to 6, S_enc * 0.25 maps it to 4."""
    t = tl.minimum(b_amax * s_enc_per[:, None], FLT_MAX)
    s_code = e4m3_encode(t, HW)
    s_block = e4m3_decode_nonneg(s_code.to(tl.int32))
    enc = tl.minimum(
        tl.div_rn(tl.full(t.shape, 1.0, tl.float32), s_block * s_dec[:, None]), FLT_MAX
    )
    return s_code, s_block, enc


@triton.jit
def _pair_sum(v, ROWS, NUM_B, N):
    """v [ROWS, NUM_B, N] -> [ROWS, NUM_B, N / 2]: elements 2i and 2i + 1 added."""
    a, b = tl.split(tl.reshape(v, [ROWS, NUM_B, N // 2, 2]))
    return a + b


@triton.jit
def _block_sse(codes, s_block, u, finite, HW, ROWS, NUM_B):
    """`nvfp4._block_sse`: sum over each 16-block of fl(d * d), d = fl(e2m1 * s - u) (0 where
    x is NaN/Inf), as a pairwise tree of adjacent pairs -> [ROWS, NUM_B]."""
    p = e2m1_decode(codes) * s_block[:, :, None]  # exact: contraction with - u is harmless
    d = tl.where(finite, p - u, 0.0)
    sq = mul_rn(d, d, HW)
    sq = _pair_sum(sq, ROWS, NUM_B, 16)
    sq = _pair_sum(sq, ROWS, NUM_B, 8)
    sq = _pair_sum(sq, ROWS, NUM_B, 4)
    sq = _pair_sum(sq, ROWS, NUM_B, 2)
    return tl.reshape(sq, [ROWS, NUM_B])


@triton.jit
def _quantize_tile(
    x,
    b_amax,
    rows,
    row_mask,
    k0,
    K,
    s_enc,
    s_dec,
    q_ptr,
    s_ptr,
    HW,
    EVEN,
    FOUR_OVER_SIX,
    ROWS,
    BLOCK_K,
    SUMS,
):
    """x [ROWS, BLOCK_K] fp32 (columns k0 .. k0 + BLOCK_K of its rows) and its block amax
    [ROWS, BLOCK_K / 16] (finite elements only) -> packed data and block scales; a block
    holding NaN/Inf stores scale 0x7F (its element codes are computed as for the others).
    Returns the tile's fp32 (sum x^2, sum (x - dequantized)^2, non-finite count) where SUMS,
    else zeros: the dequantized value as `dequantize_nvfp4` computes it, fl(fl(e2m1 x block
    scale) x S_dec) (`triton_codecs.store_error_sums`)."""
    NUM_B: tl.constexpr = BLOCK_K // NV_BLOCK
    blocks = tl.reshape(x, [ROWS, NUM_B, NV_BLOCK])
    s_code, s_block, enc = _block_scale(b_amax, s_enc * RCP_6, s_dec, HW)
    codes = e2m1_encode(blocks * enc[:, :, None])
    if FOUR_OVER_SIX:
        s_code_4, s_block_4, enc_4 = _block_scale(b_amax, s_enc * 0.25, s_dec, HW)
        codes_4 = e2m1_encode(blocks * enc_4[:, :, None])
        u = mul_rn(blocks, tl.broadcast_to(s_enc[:, None, None], blocks.shape), HW)
        finite = is_finite(blocks)
        err_6 = _block_sse(codes, s_block, u, finite, HW, ROWS, NUM_B)
        err_4 = _block_sse(codes_4, s_block_4, u, finite, HW, ROWS, NUM_B)
        pick_4 = err_4 < err_6  # a tie (or NaN) keeps the standard map-to-6 block
        codes = tl.where(pick_4[:, :, None], codes_4, codes)
        s_code = tl.where(pick_4, s_code_4, s_code)
    lo, hi = tl.split(tl.reshape(codes, [ROWS, BLOCK_K // 2, 2]))
    packed = (lo | (hi << 4)).to(tl.uint8)
    all_finite = tl.min(is_finite(blocks).to(tl.int32), axis=2)
    s_code = tl.where(all_finite != 0, s_code, E4M3_NAN_CODE).to(tl.uint8)

    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    q_mask = row_mask[:, None] & (half < K // 2)[None, :]
    store_tile(q_ptr + rows[:, None] * (K // 2) + half[None, :], packed, q_mask, EVEN)
    store_row_scales(s_ptr, s_code, rows, row_mask, k0 // NV_BLOCK, K // NV_BLOCK, NUM_B, EVEN)
    w2 = 0.0
    d2 = 0.0
    bad = 0.0
    if SUMS:  # the stored scale byte decoded: 0x7F (a non-finite block) is NaN, as dequantized
        value = e2m1_decode(codes) * e4m3_decode(s_code.to(tl.int32))[:, :, None]
        value = tl.reshape(value * s_dec[:, None, None], [ROWS, BLOCK_K])
        w2, d2, bad = tile_error_sums(x, value, is_finite(x))
    return w2, d2, bad


@triton.jit(do_not_specialize=["M", "amax_stride"])
def _nvfp4_kernel(
    x_ptr,
    amax_ptr,
    amax_stride,
    q_ptr,
    s_ptr,
    gs_ptr,
    sums_ptr,
    M,
    K,
    PER_TOKEN: tl.constexpr,
    WRITE_GS: tl.constexpr,
    HW: tl.constexpr,
    FOUR_OVER_SIX: tl.constexpr,
    INDEX_64: tl.constexpr,
    EVEN: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUMS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    if INDEX_64:
        rows = rows.to(tl.int64)
    row_mask = rows < M
    cols = tl.arange(0, BLOCK_K)

    if SINGLE_TILE:
        mask = row_mask[:, None] & (cols < K)[None, :]
        x = load_tile(x_ptr + rows[:, None] * K + cols[None, :], mask, EVEN).to(tl.float32)
        b_amax = _block_amax(x, ROWS, BLOCK_K)
        if PER_TOKEN:
            row_amax = tl.max(b_amax, axis=1)  # finite: no NaN/Inf left in b_amax
        else:
            row_amax = load_tile(amax_ptr + rows * amax_stride, row_mask, EVEN)
    else:
        if PER_TOKEN:
            row_amax = tl.zeros([ROWS], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                c = k0 + cols
                mask = row_mask[:, None] & (c < K)[None, :]
                xk = load_tile(x_ptr + rows[:, None] * K + c[None, :], mask, EVEN)
                row_amax = tl.maximum(row_amax, finite_amax(xk.to(tl.float32), 1))
        else:
            row_amax = load_tile(amax_ptr + rows * amax_stride, row_mask, EVEN)

    s_enc = nvfp4_encode_scale(row_amax)
    s_dec = tl.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)
    if WRITE_GS == GS_PER_ROW:
        store_tile(gs_ptr + rows, s_enc, row_mask, EVEN)
    if WRITE_GS == GS_SCALAR:
        tl.store(gs_ptr + rows * 0, s_enc, mask=rows == 0)

    if SINGLE_TILE:
        w2, d2, bad = _quantize_tile(
            x,
            b_amax,
            rows,
            row_mask,
            0,
            K,
            s_enc,
            s_dec,
            q_ptr,
            s_ptr,
            HW,
            EVEN,
            FOUR_OVER_SIX,
            ROWS,
            BLOCK_K,
            SUMS,
        )
    else:
        w2 = 0.0
        d2 = 0.0
        bad = 0.0
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            mask = row_mask[:, None] & (c < K)[None, :]
            xk = load_tile(x_ptr + rows[:, None] * K + c[None, :], mask, EVEN).to(tl.float32)
            tile_w2, tile_d2, tile_bad = _quantize_tile(
                xk,
                _block_amax(xk, ROWS, BLOCK_K),
                rows,
                row_mask,
                k0,
                K,
                s_enc,
                s_dec,
                q_ptr,
                s_ptr,
                HW,
                EVEN,
                FOUR_OVER_SIX,
                ROWS,
                BLOCK_K,
                SUMS,
            )
            w2 += tile_w2
            d2 += tile_d2
            bad += tile_bad
    if SUMS:
        tl.store(sums_ptr + 3 * tl.program_id(0), w2)
        tl.store(sums_ptr + 3 * tl.program_id(0) + 1, d2)
        tl.store(sums_ptr + 3 * tl.program_id(0) + 2, bad)


def launch_nvfp4(
    x_MK: torch.Tensor,
    amax: torch.Tensor | None,
    *,
    write_global_scale: bool = True,
    four_over_six: bool = False,
    hw: bool | None = None,
    config: dict | None = None,
    sums: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(packed [M, K/2] u8, block scales [M, K/16] u8, S_enc) for x_MK contiguous [M, K].

    amax None: per token (S_enc [M]). amax fp32 [] (one for the tensor: S_enc []) or [M] (one per
    row; S_enc [M] when write_global_scale, else an empty tensor). four_over_six: the 4over6
    block scales (module docstring; the same S_enc). sums: also each program's fp32 (sum x^2,
    sum (x - dequantized)^2, non-finite count) over its rows, parts [programs, 1, 3]
    (`rows_per_program(K)` rows each), as a fourth output."""
    assert x_MK.dim() == 2 and x_MK.is_contiguous(), (x_MK.shape, x_MK.stride())
    m, k = x_MK.shape
    assert k % 16 == 0, k
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    dev = x_MK.device
    per_token = amax is None
    if per_token:
        gs = torch.empty((m,), dtype=torch.float32, device=dev)
        gs_mode, amax_arg, amax_stride = 1, gs, 0
    else:
        assert amax.dtype == torch.float32 and amax.is_contiguous() and amax.numel() in (1, m)
        scalar = amax.dim() == 0
        amax_arg, amax_stride = amax, 0 if scalar else 1
        if scalar:
            gs, gs_mode = torch.empty((), dtype=torch.float32, device=dev), 2
        elif write_global_scale:
            gs, gs_mode = torch.empty((m,), dtype=torch.float32, device=dev), 1
        else:
            gs, gs_mode = torch.empty((0,), dtype=torch.float32, device=dev), 0
    q = torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
    s = torch.empty((m, k // 16), dtype=torch.uint8, device=dev)
    single, block_k, rows = _tiling(k, cfg)
    parts = (
        torch.empty((triton.cdiv(m, rows), 1, 3), dtype=torch.float32, device=dev) if sums else q
    )
    if m == 0 or k == 0:
        if gs_mode == 2:
            gs = launch_encode_scale(amax)
        return (q, s, gs, parts) if sums else (q, s, gs)
    launcher(_nvfp4_kernel, x_MK)[(triton.cdiv(m, rows),)](
        x_MK,
        amax_arg,
        amax_stride,
        q,
        s,
        gs if gs_mode else q,
        parts,  # q, a dummy, unless sums
        m,
        k,
        PER_TOKEN=per_token,
        WRITE_GS=gs_mode,
        HW=x_MK.is_cuda if hw is None else hw,
        FOUR_OVER_SIX=four_over_six,
        INDEX_64=x_MK.numel() >= 2**31,
        EVEN=m % rows == 0 and k % block_k == 0,
        SINGLE_TILE=single,
        ROWS=rows,
        BLOCK_K=block_k,
        SUMS=sums,
        num_warps=cfg["num_warps"],
    )
    return (q, s, gs, parts) if sums else (q, s, gs)


def _tiling(k: int, cfg: dict) -> tuple[bool, int, int]:
    """(whole rows in one tile, BLOCK_K, rows per program) for rows of k elements: one tile
    width for all narrow rows (fewer compiles; masked lanes cost little there)."""
    k_pow2 = max(256, triton.next_power_of_2(k))
    single = k_pow2 <= cfg["TILE_ELEMS"]
    block_k = k_pow2 if single else cfg["LOOP_BLOCK_K"]
    return single, block_k, max(1, cfg["TILE_ELEMS"] // block_k) if single else 1


def rows_per_program(k: int, config: dict | None = None) -> int:
    """Rows of k elements each program of `launch_nvfp4` quantizes (its parts' rows)."""
    return _tiling(k, {**DEFAULT_CONFIG, **(config or {})})[2]
