"""`mxrl.kernels.quantize`: `mxrl.formats.quantize` on the chosen backend, same bytes; and
`mxrl.kernels.dequantize`: `mxrl.formats.dequantize(...).to(bfloat16)`, same bytes, without the
fp32 tensor in between.

The reference backend calls `mxrl.formats.quantize`; the triton backend calls the torch ops of
`mxrl.kernels.ops` (imported on first use, so that this module imports without triton). Input
validation and error messages are the reference's own.

Variants the kernels implement (the defaults): mxfp8 RCEIL (row-wise, and column-wise along
dim -2), nvfp4 in TE order, with the standard ("te") or the 4over6 block scales (per tensor,
per token, or a caller's global amax), fp8_block with
fp32 or ue8m0 scales and blocks (1, b) / (b, b) for b in 16, 32, 64, 128. The comparison-only
modes of the reference (mxfp8 "floor", nvfp4 "torchao") and other axes raise ValueError on the
triton backend: ask for backend "reference" for those.
"""

from __future__ import annotations

from typing import Any

import torch

from mxrl.formats import QTensor, decode_global_scale
from mxrl.formats import constants as C
from mxrl.formats import dequantize as reference_dequantize
from mxrl.formats import quantize as reference_quantize
from mxrl.formats.api import QuantizeOptions, check_request
from mxrl.formats.nvfp4 import caller_amax
from mxrl.kernels.backend import Backend, Kernels, backend_for, tracing

KERNEL_SCALE_MODES = {C.Format.MXFP8: ("rceil",), C.Format.NVFP4: ("te", "4over6")}
KERNEL_SCALE_MODES[C.Format.FP8_BLOCK] = ("fp32", "ue8m0")
KERNEL_FP8_BLOCK_SIZES = (16, 32, 64, 128)


def quantize(
    x: torch.Tensor,
    fmt: C.Format | str,
    *,
    backend: Kernels | Backend | str | None = None,
    **options: Any,
) -> QTensor:
    """`mxrl.formats.quantize(x, fmt, **options)` (the same options, `QuantizeOptions`; the same
    bytes) on `backend`. An unknown option is a TypeError.

    backend: a `Backend` chosen once from config (`select_backend`); None means the default for
    x's device (triton on CUDA when available, the reference elsewhere)."""
    return _quantize(x, fmt, backend, options, sums=False)[0]


def quantize_measured(
    x: torch.Tensor,
    fmt: C.Format | str,
    *,
    backend: Kernels | Backend | str | None = None,
    **options: Any,
) -> tuple[QTensor, torch.Tensor | None]:
    """`quantize(x, fmt, backend=backend, **options)` (the same bytes) and, where a Triton
    kernel quantizes x, what the export measures of x from that same read: fp32 parts
    [G, P, 3] of (sum x^2, sum (x - dequantized)^2, the count of non-finite x), one per
    program, in G groups of equal programs; a 3-D [E, N, K] x is one group per matrix where no
    program's rows cross two (`mxrl.kernels.ops._grouped`). The first two are the SQNR's
    terms (`error_sums`), each an fp32 sum over the program's tile as `error_sums`'s kernel
    sums its tiles; the third is the NaN/Inf check's. None where the reference quantizes, and
    for the variants the kernels do not measure (MXFP8 along dim -2, NVFP4 per token or with
    its own amax pass): the caller reads x again for those."""
    return _quantize(x, fmt, backend, options, sums=True)


def _quantize(x, fmt, backend, options: dict, sums: bool) -> tuple[QTensor, torch.Tensor | None]:
    opts = QuantizeOptions(**options)
    chosen = backend_for(backend, x.device if isinstance(x, torch.Tensor) else None)
    if chosen is Backend.REFERENCE:
        return reference_quantize(x, fmt, **opts.kwargs()), None
    # the reference's checks and order (the non-finite check before the kernels' own refusals)
    fmt = check_request(x, fmt, opts)
    mode = _kernel_scale_mode(fmt, opts.scale_mode)
    axis, per_token, global_amax = opts.axis, opts.per_token, opts.global_amax
    if fmt is C.Format.MXFP8:
        ndim = x.dim()
        if axis in (-1, ndim - 1):
            if sums:
                q, s, parts = _kernel("quantize_mxfp8_sums")(x)
                return QTensor(q, s.view(torch.float8_e8m0fnu), fmt, x.shape), parts
            q, s, _, _ = _kernel("quantize_mxfp8")(x, True, False)
            return QTensor(q, s.view(torch.float8_e8m0fnu), fmt, x.shape), None
        if ndim >= 2 and axis % ndim == ndim - 2:
            _, _, q, s = _kernel("quantize_mxfp8")(x, False, True)
            return QTensor(q, s.view(torch.float8_e8m0fnu), fmt, x.shape, axis=ndim - 2), None
        raise ValueError(
            f"mxfp8 axis={axis} on shape {tuple(x.shape)}: the triton kernels block along the "
            "last dim or dim -2 (column-wise copy); use backend 'reference' for other axes"
        )
    if fmt is C.Format.NVFP4:
        if per_token and global_amax is not None:
            raise ValueError(
                "nvfp4: per_token=True computes one amax per row; global_amax cannot be "
                "combined with it (pass one or the other)"
            )
        g = None
        if global_amax is not None:
            # checked, also against x's own amax: one more read of x, and the host read of
            # the check (check_amax=False, the hot paths' choice, skips both)
            data = _finite_magnitude(x) if opts.check_amax else None
            g = caller_amax(global_amax, x.shape, x.device, check=opts.check_amax, data_amax=data)
        four = mode == "4over6"
        parts = None
        if sums and g is not None:
            q, s, gs, parts = _kernel("quantize_nvfp4_sums")(x, g, four)
        else:
            q, s, gs = _kernel("quantize_nvfp4")(x, g, per_token, four)
        return QTensor(q, s.view(torch.float8_e4m3fn), fmt, x.shape, global_scale=gs), parts
    br, bk = opts.block or C.FP8_BLOCK_WEIGHT
    if bk not in KERNEL_FP8_BLOCK_SIZES:
        raise ValueError(
            f"fp8_block block {(br, bk)}: the triton kernels take b in {KERNEL_FP8_BLOCK_SIZES}; "
            "use backend 'reference' for other block sizes"
        )
    if sums:
        q, sf, parts = _kernel("quantize_fp8_block_sums")(x, br, bk, mode == "ue8m0")
        return QTensor(q, sf, fmt, x.shape), parts
    q, sf = _kernel("quantize_fp8_block")(x, br, bk, mode == "ue8m0")
    return QTensor(q, sf, fmt, x.shape), None


def _finite_magnitude(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and ±Inf as 0 (what every amax is taken over), fp32."""
    mag = x.detach().abs().to(torch.float32)
    return torch.where(torch.isfinite(mag), mag, torch.zeros_like(mag))


def quantize_mxfp8_both(
    x: torch.Tensor, *, check_finite: bool = False, backend: Kernels | Backend | str | None = None
) -> tuple[QTensor, QTensor]:
    """MXFP8 row-wise (1x32 along K) and column-wise (32x1 along dim -2) copies of x [..., M, K],
    each quantized from x (DESIGN.md §1), equal to `formats.quantize(x, "mxfp8")` and
    `formats.quantize(x, "mxfp8", axis=x.dim() - 2)`. The triton backend reads x once."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize_mxfp8_both takes a [..., M, K] tensor, got {got}")
    col_axis = x.dim() - 2
    chosen = backend_for(backend, x.device)
    if chosen is Backend.REFERENCE:
        row = reference_quantize(x, C.Format.MXFP8, check_finite=check_finite)
        return row, reference_quantize(x, C.Format.MXFP8, axis=col_axis)
    check_request(x, C.Format.MXFP8, QuantizeOptions())
    check_request(x, C.Format.MXFP8, QuantizeOptions(axis=col_axis, check_finite=check_finite))
    q_row, s_row, q_col, s_col = _kernel("quantize_mxfp8")(x, True, True)
    e8m0 = torch.float8_e8m0fnu
    return (
        QTensor(q_row, s_row.view(e8m0), C.Format.MXFP8, x.shape),
        QTensor(q_col, s_col.view(e8m0), C.Format.MXFP8, x.shape, axis=col_axis),
    )


def dequantize(
    q: QTensor,
    *,
    global_scale: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    backend: Kernels | Backend | str | None = None,
) -> torch.Tensor:
    """`mxrl.formats.dequantize(q, global_scale=global_scale).to(dtype)`, bit for bit.

    The triton backend writes bf16 straight from the packed bytes (one read, one 2-byte write
    per element) for mxfp8 row-wise and column-wise (dim -2) copies, nvfp4 (with or without its
    global scale) and fp8_block blocks that divide the tensor; other dtypes and layouts (an
    mxfp8 copy along another axis, fp8_block blocks that overhang the tensor) run the reference:
    the same bytes, without the speed."""
    chosen = backend_for(backend, q.device)
    if chosen is not Backend.REFERENCE and dtype == torch.bfloat16 and len(q.shape) >= 1:
        operands = _dequant_operands(q, global_scale)
        if operands is not None:
            return _kernel("dequantize_bf16")(*operands)
    return reference_dequantize(q, global_scale=global_scale).to(dtype)


def _dequant_operands(q: QTensor, global_scale: bool) -> tuple | None:
    """The dequant kernel's arguments for `q` (qdata, scale bytes, NVFP4's S_dec or None, the
    format code, shape, block rows and columns), or None where it does not take the layout."""
    block = _dequant_block(q)
    if block is None:
        return None
    fmt = q.fmt
    s_dec = decode_global_scale(q) if fmt is C.Format.NVFP4 and global_scale else None
    scale = q.scale if fmt is C.Format.FP8_BLOCK else q.scale.view(torch.uint8)
    code = {C.Format.MXFP8: 0, C.Format.NVFP4: 1, C.Format.FP8_BLOCK: 2}[fmt]
    return q.qdata, scale, s_dec, code, list(q.shape), *block


def error_sums(
    q: QTensor, master: torch.Tensor, *, backend: Kernels | Backend | str | None = None
) -> torch.Tensor:
    """float64 [sum w^2, sum (w - dequantize(q))^2] of the master weight `master` against its
    quantization `q` (the SQNR's two terms, `mxrl.weights.event`). The reference: the fp32
    dequantization, then float64 sums of fp32 squares. The triton backend (a layout its dequant
    kernel takes): one pass reading both, fp32 sums per tile added in float64 (the same terms
    up to fp32 rounding inside a tile: a relative 1e-6, far below what a dB value shows)."""
    chosen = backend_for(backend, q.device)
    master = master.detach() if master.requires_grad else master  # (the export's are detached)
    if chosen is not Backend.REFERENCE and master.dtype in (torch.float32, torch.bfloat16):
        operands = _dequant_operands(q, global_scale=True)
        if operands is not None:
            return _kernel("dequantize_error_sums")(*operands, master)
    ref = master.float()
    err = ref - reference_dequantize(q).to(device=ref.device, dtype=torch.float32)
    return torch.stack(
        [ref.square().sum(dtype=torch.float64), err.square().sum(dtype=torch.float64)]
    )


def qdq_mxfp8(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    colwise: bool = False,
    backend: Kernels | Backend | str | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The bf16 operands of x's MXFP8 copies, each `dequantize(quantize(x, "mxfp8", axis=...))`
    in bf16 (row-wise: blocks along K; column-wise: along dim -2), None for a copy not asked
    for. The triton backend reads x once and writes only the bf16 values (no codes, no scales):
    what a GEMM on the emulated MXFP8 operand needs when nothing keeps the quantized bytes."""
    if not rowwise and not colwise:
        raise ValueError("qdq_mxfp8: ask for the row-wise copy, the column-wise one, or both")
    if not isinstance(x, torch.Tensor) or (colwise and x.dim() < 2):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"qdq_mxfp8 takes a [..., M, K] tensor, got {got}")
    chosen = backend_for(backend, x.device)
    if chosen is Backend.REFERENCE:

        def qdq(axis: int) -> torch.Tensor:
            q = reference_quantize(x, C.Format.MXFP8, axis=axis)
            return reference_dequantize(q).to(torch.bfloat16)

        return (qdq(-1) if rowwise else None), (qdq(x.dim() - 2) if colwise else None)
    check_request(x, C.Format.MXFP8, QuantizeOptions())
    if colwise:
        check_request(x, C.Format.MXFP8, QuantizeOptions(axis=x.dim() - 2))
    row, col = _kernel("qdq_mxfp8")(x, rowwise, colwise)
    return (row if rowwise else None), (col if colwise else None)


def quantize_mxfp8_padded(
    x: torch.Tensor,
    gather: torch.Tensor,
    *,
    col_qdq: bool = False,
    rowwise: bool = True,
    backend: Kernels | Backend | str | None = None,
) -> tuple[torch.Tensor | None, QTensor | torch.Tensor]:
    """MXFP8's quantized backward's two copies of x [R, K] (rows sorted by expert): the
    row-wise one as its bf16 values [R, K] (`qdq_mxfp8(x)`), and the column-wise one (32x1
    blocks) of the padded [P, K] tensor whose row i is x's row gather[i], zeros where
    gather[i] < 0 (each expert's rows from a 32-aligned start): its QTensor (axis 0) or, with
    col_qdq, its bf16 values. The triton backend reads x once for both and writes no padded
    copy of x; the same bytes as `qdq_mxfp8` and `quantize(padded, "mxfp8", axis=0)`.
    rowwise False: the column-wise copy alone (None for the row-wise one), for a gather that
    reads a row of x more than once (x's tokens, each in k rows)."""
    chosen = backend_for(backend, x.device)
    p, k = gather.shape[0], x.shape[-1]
    if chosen is Backend.REFERENCE or x.dim() != 2 or k % C.MXFP8_BLOCK or p % C.MXFP8_BLOCK:
        row = qdq_mxfp8(x, backend=chosen)[0] if rowwise else None
        padded = padded_rows(x, gather)
        if col_qdq:
            return row, qdq_mxfp8(padded, rowwise=False, colwise=True, backend=chosen)[1]
        return row, quantize(padded, C.Format.MXFP8, axis=0, backend=chosen)
    check_request(x, C.Format.MXFP8, QuantizeOptions())
    row, col, s_col = _kernel("quantize_mxfp8_padded")(x, gather.to(torch.int32), col_qdq, rowwise)
    row = row if rowwise else None
    if col_qdq:
        return row, col
    scale = s_col.view(torch.float8_e8m0fnu)
    return row, QTensor(col, scale, C.Format.MXFP8, torch.Size((p, k)), axis=0)


def padded_rows(x: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    """[P, K]: row i is x's row gather[i], zeros where gather[i] < 0 (the padded layout the
    quantized backward's column-wise copies are made in; torch ops, what
    `quantize_mxfp8_padded`'s kernel reads without writing it)."""
    index = torch.where(gather >= 0, gather.long(), x.shape[0])  # x.shape[0]: the zero row
    return torch.cat([x, x.new_zeros((1, x.shape[1]))]).index_select(0, index)


def to_float32(x: torch.Tensor, *, backend: Kernels | Backend | str | None = None) -> torch.Tensor:
    """x.to(torch.float32), the same bits; for a bf16 x on the triton backend one copy-speed
    kernel (`triton_dequant.launch_widen_bf16`) instead of torch's generic casting loop."""
    chosen = backend_for(backend, x.device)
    if chosen is Backend.REFERENCE or x.dtype != torch.bfloat16:
        return x.to(torch.float32)
    return _kernel("widen_bf16")(x)


def scale_bf16(
    y: torch.Tensor, scale: torch.Tensor, *, backend: Kernels | Backend | str | None = None
) -> torch.Tensor:
    """`(y.float() * scale).to(torch.bfloat16)` for a bf16 y [R, N] and an fp32 scale that
    broadcasts to it (per row [R, 1], or per element), the same bits; on the triton backend
    one copy-speed kernel (`triton_dequant.launch_scale_bf16`) instead of torch's three
    passes through two fp32 [R, N] tensors."""
    chosen = backend_for(backend, y.device)
    fits = y.dim() == 2 and torch.broadcast_shapes(scale.shape, y.shape) == y.shape
    if chosen is Backend.REFERENCE or y.dtype != torch.bfloat16 or not fits:
        return (y.float() * scale).to(torch.bfloat16)
    if scale.dtype != torch.float32:
        raise TypeError(f"scale_bf16 takes a float32 scale, got {scale.dtype}")
    return _kernel("scale_bf16")(y, scale)


def _dequant_block(q: QTensor) -> tuple[int, int] | None:
    """(rows, cols) of one scale block in the [prod(shape[:-1]), K] view, or None where the
    kernel does not take the layout."""
    k = q.shape[-1]
    if q.fmt is C.Format.MXFP8:
        if q.axis in (-1, len(q.shape) - 1):
            return (1, C.MXFP8_BLOCK)
        if len(q.shape) >= 2 and q.axis == len(q.shape) - 2:
            return (C.MXFP8_BLOCK, 1)
        return None
    if q.fmt is C.Format.NVFP4:
        return (1, C.NVFP4_BLOCK)
    br, bk = q.block
    rows = q.shape[-2] if len(q.shape) >= 2 else 1
    if k % bk or rows % br or (br > 1 and len(q.shape) < 2) or (br & (br - 1)) or (bk & (bk - 1)):
        return None  # overhanging blocks, or not powers of two (the kernel's tiles hold whole ones)
    return (br, bk)


def _kernel_scale_mode(fmt: C.Format, scale_mode: str | None) -> str:
    modes = KERNEL_SCALE_MODES[fmt]
    mode = modes[0] if scale_mode is None else scale_mode
    if mode not in modes:
        raise ValueError(
            f"{fmt} scale_mode={scale_mode!r}: the triton kernels implement {modes}; "
            f"use backend 'reference' for the comparison-only modes"
        )
    return mode


def _kernel(name: str):
    """The torch op `mxrl::name` where something traces (torch.compile, or a dispatch mode such
    as FakeTensorMode or make_fx), else its body (`ops.EAGER`): the same kernels, without the
    custom-op dispatch's host time."""
    ops = _ops()
    return getattr(ops, name) if tracing() else ops.EAGER[name]


def _ops():
    from mxrl.kernels import ops  # imports triton: only on the triton backend

    return ops
