"""DeepSeek-V3-style block FP8 quantizer (Triton): 1 x bk activation blocks and bk x bk weight
blocks. Matches `mxrl.formats.fp8_block.quantize_fp8_block` byte for byte (DeepGEMM, spec §5.2):
  a = max(amax, 1e-4);  sf = fl(a / 448)   [ue8m0: sf = 2^clamp(ceil_e8m0(sf), 1, 254) - 127]
  q = E4M3_satfinite(fl(x * fl(1 / sf)));  stored scale = sf (fp32 decode scale)
  [ue8m0: q saturates to ±240 instead of ±448 at sf = 2^120, so that q x sf is finite]

Legend: x_MK [M, K] (1 x bk: per row); x_BRK [B, R, K] (bk x bk over the last two dims of each
of B matrices; a partial last row-block takes its amax over the rows that exist, which equals
the reference's zero padding). Non-finite inputs as the reference: amax over the finite
elements (`finite_amax`), NaN/±Inf elements -> 0x7F (`e4m3_encode_masked`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxrl.formats import constants as C
from mxrl.kernels.backend import launcher
from mxrl.kernels.triton_codecs import (
    E4M3_MAX,
    E8M0_MAX_CODE,
    ceil_e8m0,
    e4m3_decode,
    e4m3_encode_limited,
    e4m3_encode_masked,
    e4m3_limit,
    e8m0_to_f32,
    finite_amax,
    is_finite,
    load_tile,
    store_error_sums,
    store_row_scales,
    store_tile,
)

AMAX_FLOOR: tl.constexpr = tl.constexpr(C.f32_from_bits(0x38D1B717))  # fl(1e-4)
assert AMAX_FLOOR.value == torch.tensor(C.FP8_BLOCK_AMAX_FLOOR, dtype=torch.float32).item()

# 1 x bk: ROWS rows of BLOCK_K columns per program; bk x bk: one block per program.
DEFAULT_CONFIG = {"ROWS": 16, "BLOCK_K": 512, "num_warps": 4, "num_warps_2d": 8}
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)


@triton.jit
def block_decode_scale(amax, UE8M0: tl.constexpr):
    """Block amax (finite, NaN/Inf already dropped) -> (fp32 decode scale sf, the elements'
    E4M3 cap: 448, or with ue8m0 240 at sf = 2^120, `e4m3_limit`)."""
    sf = tl.div_rn(tl.maximum(amax, AMAX_FLOOR), tl.full(amax.shape, E4M3_MAX, tl.float32))
    limit = tl.full(amax.shape, E4M3_MAX, tl.float32)
    if UE8M0:
        code = tl.minimum(tl.maximum(ceil_e8m0(sf), 1), E8M0_MAX_CODE)  # (ceil caps at 254)
        sf = e8m0_to_f32(code)
        limit = e4m3_limit(code)
    return sf, limit


@triton.jit(do_not_specialize=["M"])
def _fp8_block_1d_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    sums_ptr,
    M,
    K,
    UE8M0: tl.constexpr,
    HW: tl.constexpr,
    INDEX_64: tl.constexpr,
    EVEN: tl.constexpr,
    BK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUMS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    if INDEX_64:
        rows = rows.to(tl.int64)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    offs = rows[:, None] * K + cols[None, :]
    x = load_tile(x_ptr + offs, mask, EVEN).to(tl.float32)
    NUM_B: tl.constexpr = BLOCK_K // BK
    blocks = tl.reshape(x, [ROWS, NUM_B, BK])
    sf, limit = block_decode_scale(finite_amax(blocks, 2), UE8M0)
    rcp = tl.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf)
    v = tl.reshape(blocks * rcp[:, :, None], [ROWS, BLOCK_K])
    if UE8M0:
        lim = tl.reshape(tl.broadcast_to(limit[:, :, None], [ROWS, NUM_B, BK]), [ROWS, BLOCK_K])
        q = e4m3_encode_limited(v, lim, is_finite(x), HW)
    else:  # fp32 scales: 448 x sf is finite, no cap below 448 (the reference's limit=None)
        q = e4m3_encode_masked(v, is_finite(x), HW)
    store_tile(q_ptr + offs, q, mask, EVEN)
    store_row_scales(s_ptr, sf, rows, rows < M, tl.program_id(1) * NUM_B, K // BK, NUM_B, EVEN)
    if SUMS:
        value = tl.reshape(e4m3_decode(q.to(tl.int32)), [ROWS, NUM_B, BK]) * sf[:, :, None]
        part = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        store_error_sums(sums_ptr, part, x, tl.reshape(value, [ROWS, BLOCK_K]), is_finite(x))


@triton.jit(do_not_specialize=["R", "NUM_RB"])
def _fp8_block_2d_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    sums_ptr,
    R,
    K,
    NUM_RB,
    UE8M0: tl.constexpr,
    HW: tl.constexpr,
    INDEX_64: tl.constexpr,
    EVEN: tl.constexpr,
    BK: tl.constexpr,
    SUMS: tl.constexpr,
):
    pid_r = tl.program_id(0)  # batch * NUM_RB + row block
    pid_k = tl.program_id(1)
    batch = pid_r // NUM_RB
    rb = pid_r % NUM_RB
    rows = rb * BK + tl.arange(0, BK)
    cols = pid_k * BK + tl.arange(0, BK)
    base = batch * R
    if INDEX_64:
        base = base.to(tl.int64)
    mask = (rows < R)[:, None] & (cols < K)[None, :]
    offs = (base + rows)[:, None] * K + cols[None, :]
    x = load_tile(x_ptr + offs, mask, EVEN).to(tl.float32)
    amax = tl.max(finite_amax(x, 1), axis=0)
    sf, limit = block_decode_scale(amax, UE8M0)
    rcp = tl.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf)
    if UE8M0:
        q = e4m3_encode_limited(x * rcp, limit, is_finite(x), HW)  # one block, one cap
    else:
        q = e4m3_encode_masked(x * rcp, is_finite(x), HW)
    store_tile(q_ptr + offs, q, mask, EVEN)
    tl.store(s_ptr + pid_r * (K // BK) + pid_k, sf)
    if SUMS:
        value = e4m3_decode(q.to(tl.int32)) * sf
        part = pid_r * tl.num_programs(1) + pid_k
        store_error_sums(sums_ptr, part, x, value, is_finite(x))


def launch_fp8_block(
    x_BRK: torch.Tensor,
    block: tuple[int, int],
    ue8m0: bool,
    *,
    hw: bool | None = None,
    config: dict | None = None,
    sums: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(q [B, R, K] u8, sf fp32 [B, ceil(R/br), K/bk]) for contiguous x_BRK [B, R, K].

    block (1, bk): per-row blocks (B, R are just leading dims); (bk, bk): square blocks.
    sums: also each program's fp32 (sum x^2, sum (x - dequantized)^2, non-finite count) over
    its tile (`store_error_sums`), as a third output: parts [G, P, 3], G groups of programs of
    equal rows, one per matrix for square blocks, one per ROWS rows (a row of programs) for
    per-row blocks."""
    assert x_BRK.dim() == 3 and x_BRK.is_contiguous(), (x_BRK.shape, x_BRK.stride())
    br, bk = block
    assert bk in SUPPORTED_BLOCK_SIZES and br in (1, bk), block
    b, r, k = x_BRK.shape
    assert k % bk == 0, (k, bk)
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    dev = x_BRK.device
    num_rb = triton.cdiv(r, br)
    q = torch.empty((b, r, k), dtype=torch.uint8, device=dev)
    sf = torch.empty((b, num_rb, k // bk), dtype=torch.float32, device=dev)
    block_k, rows = max(bk, cfg["BLOCK_K"]), cfg["ROWS"]
    if br == 1:
        grid = (triton.cdiv(b * r, rows), triton.cdiv(k, block_k))
        groups = grid[0]
    else:
        grid = (b * num_rb, k // bk)
        groups = b
    parts = torch.empty((groups, grid[0] * grid[1] // groups if groups else 0, 3),
                        dtype=torch.float32, device=dev) if sums else sf  # fmt: skip
    outputs = (q, sf, parts) if sums else (q, sf)
    if q.numel() == 0:
        return outputs
    hw = x_BRK.is_cuda if hw is None else hw
    index_64 = x_BRK.numel() >= 2**31
    if br == 1:
        m = b * r
        launcher(_fp8_block_1d_kernel, x_BRK)[grid](
            x_BRK,
            q,
            sf,
            parts,
            m,
            k,
            UE8M0=ue8m0,
            HW=hw,
            INDEX_64=index_64,
            EVEN=m % rows == 0 and k % block_k == 0,
            BK=bk,
            ROWS=rows,
            BLOCK_K=block_k,
            SUMS=sums,
            num_warps=cfg["num_warps"],
        )
    else:
        launcher(_fp8_block_2d_kernel, x_BRK)[grid](
            x_BRK,
            q,
            sf,
            parts,
            r,
            k,
            num_rb,
            UE8M0=ue8m0,
            HW=hw,
            INDEX_64=index_64,
            EVEN=r % bk == 0,
            BK=bk,
            SUMS=sums,
            num_warps=cfg["num_warps_2d"],
        )
    return outputs
