"""Dequantize to bf16 (Triton): one read of the packed bytes, one bf16 write.

Matches `mxrl.formats.dequantize(q, global_scale=...).to(torch.bfloat16)` bit for bit, for
  mxfp8      row-wise (1x32 along K) and column-wise (32x1 along M) scales;
  nvfp4      1x16 E4M3 block scales, with or without the FP32 decode scale S_dec per row;
  fp8_block  fp32 block scales of (1, bk) or (br, bk) blocks that divide the tensor;
without the fp32 tensor the reference writes and converts. Beside them, two bf16 conversions at
copy speed: the exact widening to fp32 (`launch_widen_bf16`) and a bf16 tensor scaled in fp32
and rounded back (`launch_scale_bf16`, the NVFP4 GEMMs' global scales on a bf16 output). Each element is computed as the
reference computes it: the element value times its block scale in fp32 (exact: an E4M3 or E2M1
value times a power of two or an E4M3 scale has few significant bits), times S_dec in fp32 (one
rounding, as `dequantize_nvfp4`) for NVFP4 with its global scale, then one round to nearest
even into bf16. HW (CUDA): `cvt.rn.bf16.f32`, which is what torch's CUDA `.to(bfloat16)` runs
(NaN -> 0x7FFF). Not HW (the interpreter, on CPU tensors): the same rounding on the fp32 bit
pattern, NaN -> 0x7FC0 as torch's CPU conversion, since the interpreter's float casts are
NumPy's.

Legend: the logical tensor viewed as [M, K] (leading dims flattened, K contiguous); a scale
tensor viewed as [M / SR, K / SK] (SR, SK: the block's rows and columns), which holds for every
layout above because no block crosses a matrix of the flattened leading dims.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mxrl.kernels.backend import launcher
from mxrl.kernels.triton_codecs import (
    FMT_MXFP8,
    FMT_NVFP4,
    e2m1_decode,
    e4m3_decode,
    e8m0_to_f32,
    nan_like,
    store_bf16,
)

DEFAULT_CONFIG = {"BLOCK_M": 16, "BLOCK_K": 512, "num_warps": 8}


@triton.jit
def _tile_values(
    q_ptr,
    s_ptr,
    g_ptr,
    M,
    K,
    FMT: tl.constexpr,
    SR: tl.constexpr,
    SK: tl.constexpr,
    HAS_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The program's tile of dequantized values, fp32 [BLOCK_M, BLOCK_K], exactly as the
    reference computes them (module docstring), with its rows, columns and mask."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    if FMT == FMT_NVFP4:  # a byte holds elements 2i (low nibble) and 2i + 1 (high)
        HALF: tl.constexpr = BLOCK_K // 2
        pcols = tl.program_id(1) * HALF + tl.arange(0, HALF)
        pmask = (rows < M)[:, None] & (pcols < K // 2)[None, :]
        byte = tl.load(q_ptr + rows[:, None] * (K // 2) + pcols[None, :], mask=pmask, other=0)
        byte = byte.to(tl.int32)
        pair = tl.join(e2m1_decode(byte & 0xF), e2m1_decode(byte >> 4))
        value = tl.reshape(pair, [BLOCK_M, BLOCK_K])
    else:
        code = tl.load(q_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0)
        value = e4m3_decode(code.to(tl.int32))
    # one scale per (SR x SK) block: loaded and decoded once, broadcast over its block
    NR: tl.constexpr = BLOCK_M // SR
    NK: tl.constexpr = BLOCK_K // SK
    s_rows = tl.program_id(0) * NR + tl.arange(0, NR).to(tl.int64)
    s_cols = tl.program_id(1) * NK + tl.arange(0, NK)
    s_mask = (s_rows < M // SR)[:, None] & (s_cols < K // SK)[None, :]
    s_ptrs = s_ptr + s_rows[:, None] * (K // SK) + s_cols[None, :]
    if FMT == FMT_MXFP8:
        s_code = tl.load(s_ptrs, mask=s_mask, other=127).to(tl.int32)
        scale = tl.where(s_code == 255, nan_like(s_code), e8m0_to_f32(s_code))
    elif FMT == FMT_NVFP4:
        scale = e4m3_decode(tl.load(s_ptrs, mask=s_mask, other=0x38).to(tl.int32))
    else:  # FMT_FP8_BLOCK: fp32 scales
        scale = tl.load(s_ptrs, mask=s_mask, other=1.0)
    blocks = tl.reshape(value, [NR, SR, NK, SK]) * tl.reshape(scale, [NR, 1, NK, 1])
    value = tl.reshape(blocks, [BLOCK_M, BLOCK_K])
    if HAS_G:
        value = value * tl.load(g_ptr + rows, mask=rows < M, other=1.0)[:, None]
    return value, rows, cols, mask


@triton.jit(do_not_specialize=["M"])
def _dequant_kernel(
    q_ptr,
    s_ptr,
    g_ptr,
    out_ptr,
    M,
    K,
    FMT: tl.constexpr,
    SR: tl.constexpr,
    SK: tl.constexpr,
    HAS_G: tl.constexpr,
    HW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    value, rows, cols, mask = _tile_values(
        q_ptr, s_ptr, g_ptr, M, K, FMT, SR, SK, HAS_G, BLOCK_M, BLOCK_K
    )
    store_bf16(out_ptr + rows[:, None] * K + cols[None, :], value, mask, HW)


@triton.jit(do_not_specialize=["M"])
def _error_sums_kernel(
    q_ptr,
    s_ptr,
    g_ptr,
    w_ptr,
    part_ptr,
    M,
    K,
    FMT: tl.constexpr,
    SR: tl.constexpr,
    SK: tl.constexpr,
    HAS_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program's (sum w^2, sum (w - dequantized)^2) over its tile, fp32, into part_ptr
    [programs, 2]: the SQNR's sums in one read of the master tile and the packed bytes."""
    value, rows, cols, mask = _tile_values(
        q_ptr, s_ptr, g_ptr, M, K, FMT, SR, SK, HAS_G, BLOCK_M, BLOCK_K
    )
    w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    d = tl.where(mask, w - value, 0.0)
    part = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(part_ptr + 2 * part, tl.sum(tl.sum(w * w, axis=1), axis=0))
    tl.store(part_ptr + 2 * part + 1, tl.sum(tl.sum(d * d, axis=1), axis=0))


class DequantOperands(NamedTuple):
    """A quantized tensor as the kernels read it: contiguous packed bytes qdata_MP ([M, K], or
    [M, K/2] for nvfp4), a contiguous scale of M/SR x K/SK elements (uint8 codes, or fp32 for
    fp8_block), decode_rows (nvfp4 with its global scale: fp32 [M] S_dec per row; else None),
    the format code fmt (`triton_codecs.FMT_*`), M, K and block = (SR, SK)."""

    qdata_MP: torch.Tensor
    scale: torch.Tensor
    decode_rows: torch.Tensor | None
    fmt: int
    m: int
    k: int
    block: tuple[int, int]


def _tile_config(block: tuple[int, int], config: dict | None) -> dict:
    """The launch config: a tile holds whole scale blocks (BLOCK_M a multiple of SR, BLOCK_K of
    SK, powers of two), at most 8192 elements."""
    sr, sk = block
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    cfg["BLOCK_M"], cfg["BLOCK_K"] = max(cfg["BLOCK_M"], sr), max(cfg["BLOCK_K"], sk)
    if cfg["BLOCK_M"] * cfg["BLOCK_K"] > 8192:
        cfg["BLOCK_K"] = max(sk, 8192 // cfg["BLOCK_M"])
    return cfg


def _check_operands(operands: DequantOperands) -> None:
    """Dense packed bytes and scales, whole blocks of powers of two (the tiles hold whole ones)."""
    qdata_MP, scale, _, _, m, k, block = operands
    sr, sk = block
    assert qdata_MP.is_contiguous() and scale.is_contiguous(), "the launcher gets dense inputs"
    assert k % sk == 0 and m % sr == 0 and scale.numel() == (m // sr) * (k // sk), (m, k, block)
    assert sr & (sr - 1) == 0 and sk & (sk - 1) == 0, f"blocks of powers of two, got {block}"


def _grid(operands: DequantOperands, cfg: dict) -> tuple[int, int]:
    return triton.cdiv(operands.m, cfg["BLOCK_M"]), triton.cdiv(operands.k, cfg["BLOCK_K"])


def _launch(kernel, cfg: dict, operands: DequantOperands, *outputs, **constexprs) -> None:
    """`kernel` (`_dequant_kernel`, `_error_sums_kernel`) over the tiles of `operands`, its
    `outputs` after the three input pointers."""
    qdata_MP, scale, decode_rows, fmt, m, k, (sr, sk) = operands
    launcher(kernel, qdata_MP)[_grid(operands, cfg)](
        qdata_MP,
        scale,
        decode_rows if decode_rows is not None else scale,  # a dummy unless HAS_G
        *outputs,
        m,
        k,
        FMT=fmt,
        SR=sr,
        SK=sk,
        HAS_G=decode_rows is not None,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"],
        **constexprs,
    )


def launch_error_sums(operands: DequantOperands, master_MK: torch.Tensor) -> torch.Tensor:
    """float64 [sum w^2, sum (w - dequantize(q))^2] of a contiguous master [M, K] (fp32, bf16)
    against its quantization: each program's fp32 sums over its tile, then added in float64 in
    program order (deterministic)."""
    qdata_MP, m, k = operands.qdata_MP, operands.m, operands.k
    assert master_MK.is_contiguous() and tuple(master_MK.shape) == (m, k), (master_MK.shape, m, k)
    _check_operands(operands)
    cfg = _tile_config(operands.block, None)
    grid = _grid(operands, cfg)
    parts = torch.zeros((grid[0] * grid[1], 2), dtype=torch.float32, device=qdata_MP.device)
    if m and k:
        _launch(_error_sums_kernel, cfg, operands, master_MK, parts)
    return parts.sum(dim=0, dtype=torch.float64)


def launch_dequant(
    operands: DequantOperands, *, hw: bool | None = None, config: dict | None = None
) -> torch.Tensor:
    """bf16 [M, K] of the quantized tensor `operands`."""
    _check_operands(operands)
    qdata_MP, m, k = operands.qdata_MP, operands.m, operands.k
    cfg = _tile_config(operands.block, config)
    hw = qdata_MP.is_cuda if hw is None else hw
    out = torch.empty((m, k), dtype=torch.bfloat16, device=qdata_MP.device)
    if m == 0 or k == 0:
        return out
    # not HW: the kernel stores the bf16 bits into an int16 view
    _launch(_dequant_kernel, cfg, operands, out if hw else out.view(torch.int16), HW=hw)
    return out


@triton.jit
def _widen_bf16_kernel(src_ptr, dst_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    bits = tl.load(src_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    tl.store(dst_ptr + offs, bits << 16, mask=mask)


def launch_widen_bf16(x: torch.Tensor, *, block: int = 4096) -> torch.Tensor:
    """fp32 copy of a contiguous bf16 tensor: each value's 16 bits shifted into the high half
    (exact, NaN payloads kept: what torch's conversion computes), at copy bandwidth. torch's
    own bf16 -> fp32 `.to` runs its generic casting loop, about a third of it on the H200."""
    assert x.dtype == torch.bfloat16 and x.is_contiguous(), (x.dtype, x.stride())
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        grid = (triton.cdiv(n, block),)
        launcher(_widen_bf16_kernel, x)[grid](
            x.view(torch.int16), out.view(torch.int32), n, BLOCK=block, num_warps=8
        )
    return out


@triton.jit
def _scale_bf16_kernel(
    y_ptr, s_ptr, out_ptr, total, N, s_row, s_col, HW: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    bits = tl.load(y_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    y = (bits << 16).to(tl.float32, bitcast=True)  # the bf16 value in fp32: exact
    s = tl.load(s_ptr + (offs // N) * s_row + (offs % N) * s_col, mask=mask, other=0.0)
    store_bf16(out_ptr + offs, y * s, mask, HW)


def launch_scale_bf16(
    y: torch.Tensor, scale: torch.Tensor, *, hw: bool | None = None, block: int = 4096
) -> torch.Tensor:
    """bf16 [R, N] = bf16(fp32(y) * scale): y contiguous bf16 [R, N], scale fp32 broadcast to
    it (strides 0 along a broadcast dim: a scale per row [R, 1], per column, or per element).
    One product in fp32 and one round to nearest even per element, as torch's
    `(y.float() * scale).to(torch.bfloat16)`, from one read of y and one write, where torch
    runs three passes and holds two fp32 [R, N] tensors."""
    assert y.dtype == torch.bfloat16 and y.is_contiguous() and y.dim() == 2, (y.dtype, y.shape)
    assert scale.dtype == torch.float32, scale.dtype
    s = scale.expand(y.shape)
    out = torch.empty_like(y)
    hw = y.is_cuda if hw is None else hw
    total, n = y.numel(), y.shape[1]
    if total:
        grid = (triton.cdiv(total, block),)
        launcher(_scale_bf16_kernel, y)[grid](
            y.view(torch.int16), s, out if hw else out.view(torch.int16), total, n,
            s.stride(0), s.stride(1), HW=hw, BLOCK=block, num_warps=8,
        )  # fmt: skip
    return out
