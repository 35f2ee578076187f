"""The Triton quantizers as torch ops (`torch.ops.mxrl.*`), so that torch.compile and CUDA
graphs see them whole (house style 6). `triton_op` traces the body under fake tensors, which
gives each op its fake (meta) implementation: output shapes and dtypes, no kernel launch.

Each op takes x of shape [..., K] (made contiguous here: the kernels index a dense [M, K]
view) in fp32, bf16 or fp16 and returns uint8 codes and scales in the reference's layouts:

  quantize_mxfp8(x, rowwise, colwise) -> (q_row [..., K], s_row [..., K/32],
                                          q_col [..., M, K], s_col [..., M/32, K])
  quantize_nvfp4(x, global_amax?, per_token, four_over_six) -> (q [..., K/2], s [..., K/16],
                                                                global_scale)
  quantize_fp8_block(x, block_rows, block_k, ue8m0) -> (q [..., K], sf fp32)

and, for the export (`mxrl.kernels.api.quantize_measured`), the same with per-program fp32
parts [G, P, 3] of (sum x^2, sum (x - dequantized)^2, non-finite count) from the same read:

  quantize_mxfp8_sums(x) -> (q_row, s_row, parts)
  quantize_nvfp4_sums(x, global_amax, four_over_six) -> (q, s, global_scale, parts)
  quantize_fp8_block_sums(x, block_rows, block_k, ue8m0) -> (q, sf, parts)

and the inverse to bf16 (`mxrl.kernels.triton_dequant`):

  dequantize_bf16(qdata, scale, decode_scale?, fmt, shape, block_rows, block_k) -> bf16 [shape]
  dequantize_error_sums(same, master) -> float64 [sum w^2, sum (w - dequantized)^2], one pass
  widen_bf16(x bf16) -> fp32, exact (bf16 values are fp32 values)
  scale_bf16(y bf16 [R, N], scale fp32 broadcast to it) -> bf16(fp32(y) * scale), one pass
  qdq_mxfp8(x, rowwise, colwise) -> (bf16 row-wise deq, bf16 column-wise deq), one pass
  quantize_mxfp8_padded(x [R, K], gather [P], col_qdq, rowwise) -> (bf16 row-wise deq, the
      column-wise copy of the padded [P, K] rows x[gather] (zeros where gather < 0): codes
      and scales, or its bf16 deq), one pass

A copy not asked for (rowwise / colwise False) is an empty tensor. Imports triton: load this
module only through the triton backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.library import triton_op

from mxrl.kernels.triton_dequant import (
    DequantOperands,
    launch_dequant,
    launch_error_sums,
    launch_scale_bf16,
    launch_widen_bf16,
)
from mxrl.kernels.triton_fp8_block import DEFAULT_CONFIG as FP8_BLOCK_CONFIG
from mxrl.kernels.triton_fp8_block import launch_fp8_block
from mxrl.kernels.triton_mxfp8 import DEFAULT_CONFIG as MXFP8_CONFIG
from mxrl.kernels.triton_mxfp8 import launch_mxfp8
from mxrl.kernels.triton_nvfp4 import launch_nvfp4
from mxrl.kernels.triton_nvfp4 import rows_per_program as nvfp4_rows_per_program
from mxrl.kernels.triton_nvfp4_scale import launch_encode_scale, launch_global_amax

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MXFP8_ROWS, FP8_BLOCK_ROWS = MXFP8_CONFIG["BLOCK_M"], FP8_BLOCK_CONFIG["ROWS"]  # rows a program

# Each op's body, called straight by `mxrl.kernels.api` when nothing traces (no torch.compile,
# no dispatch mode such as FakeTensorMode): the same launch without the custom-op dispatch,
# which costs ~0.15 ms of host time per call in eager mode on the H200 (measured in a training
# step, where a quantized preset calls these ops ~170 times and the host became the bottleneck).
EAGER: dict[str, Callable[..., Any]] = {}


def _op(fn: Callable[..., Any]):
    """Register fn as the torch op mxrl::<its name> (triton_op) and keep its body in EAGER."""
    EAGER[fn.__name__] = fn
    return triton_op(f"mxrl::{fn.__name__}", mutates_args=())(fn)


def _dense(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"mxrl::{what} takes float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"mxrl::{what} needs at least one dimension")
    return x.contiguous()


@_op
def quantize_mxfp8(
    x: torch.Tensor, rowwise: bool, colwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = _dense(x, "quantize_mxfp8")
    shape, k = x.shape, x.shape[-1]
    if colwise and x.dim() < 2:
        raise ValueError("mxrl::quantize_mxfp8: the column-wise copy needs a [..., M, K] tensor")
    q_row, s_row, q_col, s_col = launch_mxfp8(x.reshape(-1, k), rowwise, colwise)
    if rowwise:
        q_row, s_row = q_row.view(shape), s_row.view(*shape[:-1], k // 32)
    if colwise:
        # [..., M, K] with M % 32 == 0: the 32-row blocks of the flat [prod(...) * M, K] view
        # never cross a matrix, so its [.., M/32, K] scales are the per-matrix ones.
        q_col, s_col = q_col.view(shape), s_col.view(*shape[:-2], shape[-2] // 32, k)
    return q_row, s_row, q_col, s_col


@_op
def quantize_mxfp8_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_mxfp8(x, True, False)`'s row-wise copy, and the SQNR's terms over it from the
    same read: (q, s, parts fp32 [G, P, 3]), `_grouped`."""
    x = _dense(x, "quantize_mxfp8_sums")
    shape, k = x.shape, x.shape[-1]
    q, s, _, _, parts = launch_mxfp8(x.reshape(-1, k), True, False, sums=True)
    return q.view(shape), s.view(*shape[:-1], k // 32), _grouped(parts, shape, MXFP8_ROWS)


@_op
def quantize_nvfp4(
    x: torch.Tensor,
    global_amax: torch.Tensor | None,
    per_token: bool,
    four_over_six: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """global_amax: None (per token, or per tensor computed here) or an fp32 tensor that is a
    scalar or of x's rank with last dim 1, broadcasting over x's leading dims ([rows, 1],
    [E, 1, 1]); the global scale comes back in its shape. four_over_six: scale_mode "4over6"
    (the same global scale, other block scales)."""
    return _nvfp4(x, global_amax, per_token, four_over_six, sums=False)


@_op
def quantize_nvfp4_sums(
    x: torch.Tensor, global_amax: torch.Tensor, four_over_six: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_nvfp4(x, global_amax, False, four_over_six)` (a caller's global amax: the
    export's) and the SQNR's terms from the same read: (q, s, global scale, parts), `_grouped`."""
    return _nvfp4(x, global_amax, False, four_over_six, sums=True)


def _nvfp4(x, global_amax, per_token: bool, four_over_six: bool, sums: bool) -> tuple:
    x = _dense(x, "quantize_nvfp4")
    shape, k = x.shape, x.shape[-1]
    lead = shape[:-1]
    x_MK = x.reshape(-1, k)
    kw = {"four_over_six": four_over_six, "sums": sums}
    if per_token:
        if global_amax is not None:
            raise ValueError("mxrl::quantize_nvfp4: per_token and global_amax are exclusive")
        q, s, gs, *parts = launch_nvfp4(x_MK, None, **kw)
        gs = gs.view(*lead, 1)
    elif global_amax is None:
        q, s, gs, *parts = launch_nvfp4(x_MK, launch_global_amax(x_MK), **kw)
    elif global_amax.dim() == 0:
        g = global_amax.to(torch.float32).contiguous()
        q, s, gs, *parts = launch_nvfp4(x_MK, g, **kw)
    else:
        g = global_amax.to(torch.float32).contiguous()
        amax_rows = g.expand(*lead, 1).reshape(-1).contiguous()
        q, s, _, *parts = launch_nvfp4(x_MK, amax_rows, write_global_scale=False, **kw)
        gs = launch_encode_scale(g)
    out = (q.view(*lead, k // 2), s.view(*lead, k // 16), gs)
    return (*out, _grouped(parts[0], shape, nvfp4_rows_per_program(k))) if sums else out


def _grouped(parts: torch.Tensor, shape, rows: int) -> torch.Tensor:
    """Per-program parts [programs along M, ..., 3] of a kernel whose programs each quantize
    `rows` rows of the flat [prod(shape[:-1]), K] view, as [G, P, 3]: one group per matrix of
    a 3-D [E, N, K] tensor when no program's rows cross two matrices (N % rows == 0), else one
    group (`mxrl.weights.event.SqnrMeter` measures a sample of experts on the former)."""
    if len(shape) == 3 and shape[0] and shape[1] % rows == 0:
        return parts.reshape(shape[0], -1, 3)
    return parts.reshape(1, -1, 3)


@_op
def quantize_fp8_block(
    x: torch.Tensor, block_rows: int, block_k: int, ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    x = _dense(x, "quantize_fp8_block")
    shape, k = x.shape, x.shape[-1]
    if block_rows == 1:
        x_BRK = x.reshape(1, -1, k)
        q, sf = launch_fp8_block(x_BRK, (1, block_k), ue8m0)
        return q.view(shape), sf.view(*shape[:-1], k // block_k)
    if x.dim() < 2:
        raise ValueError("mxrl::quantize_fp8_block: square blocks need a [..., R, K] tensor")
    r = shape[-2]
    q, sf = launch_fp8_block(x.reshape(-1, r, k), (block_rows, block_k), ue8m0)
    return q.view(shape), sf.view(*shape[:-2], sf.shape[1], k // block_k)


@_op
def quantize_fp8_block_sums(
    x: torch.Tensor, block_rows: int, block_k: int, ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_fp8_block` and the SQNR's terms from the same read: (q, sf, parts fp32
    [G, P, 3]), `_grouped` (square blocks: one group per matrix, always)."""
    x = _dense(x, "quantize_fp8_block_sums")
    shape, k = x.shape, x.shape[-1]
    if block_rows == 1:
        q, sf, parts = launch_fp8_block(x.reshape(1, -1, k), (1, block_k), ue8m0, sums=True)
        parts = _grouped(parts, shape, FP8_BLOCK_ROWS)
        return q.view(shape), sf.view(*shape[:-1], k // block_k), parts
    if x.dim() < 2:
        raise ValueError("mxrl::quantize_fp8_block: square blocks need a [..., R, K] tensor")
    r = shape[-2]
    q, sf, parts = launch_fp8_block(x.reshape(-1, r, k), (block_rows, block_k), ue8m0, sums=True)
    sf = sf.view(*shape[:-2], sf.shape[1], k // block_k)
    return q.view(shape), sf, parts if x.dim() == 3 else parts.reshape(1, -1, 3)


@_op
def dequantize_bf16(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    decode_scale: torch.Tensor | None,
    fmt: int,
    shape: list[int],
    block_rows: int,
    block_k: int,
) -> torch.Tensor:
    """fmt: 0 mxfp8, 1 nvfp4, 2 fp8_block (`triton_codecs.FMT_*`); scale as uint8 codes (or
    fp32 for fp8_block); decode_scale: NVFP4's fp32 S_dec ([] or [..., 1]) to multiply by, or
    None; (block_rows, block_k): one scale's block in the [prod(shape[:-1]), K] view."""
    operands = _operands(qdata, scale, decode_scale, fmt, shape, (block_rows, block_k))
    return launch_dequant(operands).view(shape)


def _operands(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    decode_scale: torch.Tensor | None,
    fmt: int,
    shape: list[int],
    block: tuple[int, int],
) -> DequantOperands:
    """The launchers' operands: dense bytes and scales, (M, K) of the [prod(shape[:-1]), K]
    view and NVFP4's S_dec per row (fp32 [M]) or None."""
    k = shape[-1]
    m = qdata.numel() // (k // 2 if fmt == 1 else k) if k else 0
    rows = None
    if decode_scale is not None:
        rows = decode_scale.to(torch.float32).expand(*shape[:-1], 1).reshape(-1).contiguous()
    return DequantOperands(qdata.contiguous(), scale.contiguous(), rows, fmt, m, k, block)


@_op
def dequantize_error_sums(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    decode_scale: torch.Tensor | None,
    fmt: int,
    shape: list[int],
    block_rows: int,
    block_k: int,
    master: torch.Tensor,
) -> torch.Tensor:
    """float64 [sum w^2, sum (w - dequantize(q))^2] of `master` (shape, fp32 or bf16) against
    the quantization given as `dequantize_bf16` takes it: one pass over both."""
    operands = _operands(qdata, scale, decode_scale, fmt, shape, (block_rows, block_k))
    return launch_error_sums(operands, master.contiguous().view(operands.m, operands.k))


@_op
def widen_bf16(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.bfloat16:
        raise TypeError(f"mxrl::widen_bf16 takes bfloat16, got {x.dtype}")
    return launch_widen_bf16(x.contiguous())


@_op
def scale_bf16(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if y.dtype != torch.bfloat16 or scale.dtype != torch.float32 or y.dim() != 2:
        raise TypeError(
            f"mxrl::scale_bf16 takes a bfloat16 [R, N] and a float32 scale, got {y.dtype} "
            f"{tuple(y.shape)} and {scale.dtype}"
        )
    return launch_scale_bf16(y.contiguous(), scale)


@_op
def qdq_mxfp8(x: torch.Tensor, rowwise: bool, colwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (row [..., K], col [..., M, K]): each asked-for copy's dequantized values (empty if
    not asked for), from one read of x and without its codes or scales."""
    x = _dense(x, "qdq_mxfp8")
    shape, k = x.shape, x.shape[-1]
    if colwise and x.dim() < 2:
        raise ValueError("mxrl::qdq_mxfp8: the column-wise copy needs a [..., M, K] tensor")
    row, _, col, _ = launch_mxfp8(x.reshape(-1, k), rowwise, colwise, qdq=True)
    return (row.view(shape) if rowwise else row), (col.view(shape) if colwise else col)


@_op
def quantize_mxfp8_padded(
    x: torch.Tensor, gather: torch.Tensor, col_qdq: bool, rowwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 row-wise deq [R, K] (empty unless rowwise), column-wise copy [P, K] (u8 codes, or
    bf16 deq where col_qdq), its scales [P/32, K] u8 (empty where col_qdq)), one read of x."""
    x = _dense(x, "quantize_mxfp8_padded")
    if x.dim() != 2 or gather.dtype != torch.int32 or gather.dim() != 1:
        raise ValueError("mxrl::quantize_mxfp8_padded takes x [R, K] and an int32 gather [P]")
    row, _, col, s_col = launch_mxfp8(
        x, rowwise, True, qdq=True, col_qdq=col_qdq, gather=gather.contiguous()
    )
    return row, col, s_col
