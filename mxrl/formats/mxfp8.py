"""MXFP8 reference quantizer: E4M3 elements, one E8M0 scale per 32 elements (spec §2).

Legend: x_hp [..., K] high precision; blocks of 32 along `axis` (the last dim for the row-wise
copy; dim 0 of a 2-D tensor for the column-wise copy, which keeps x's layout as TE does, §2.1).

Non-finite inputs: the scale comes from the block's finite elements (`block_amax`), and a NaN or
±Inf element is stored as the E4M3 NaN byte 0x7F (`codecs.e4m3_encode`), so it dequantizes to
NaN and its block's other elements keep their bytes.
Finite inputs dequantize to finite values: a block with amax above ~2.98e38 gets the top scale
2^120 (code 247), where an element that would round to ±256 (±2^128 = ±Inf once scaled) is
stored as ±240 instead (`codecs.e4m3_limit`; docs/formats.md, "The top of the fp32 range").
"""

from __future__ import annotations

import torch

from mxrl.formats import codecs
from mxrl.formats import constants as C
from mxrl.formats.qtensor import QTensor

SCALE_MODES = ("rceil", "floor")


def block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim, over the FINITE elements only: NaN and ±Inf count as 0 (a block
    with no finite element has amax 0). Every amax of every format is taken through here, so the
    finite elements of a block holding NaN/Inf get the bytes they would get were it 0
    (docs/formats.md, "Non-finite inputs"). TE's kernels ignore NaN too (fmaxf, spec §2.4) but
    let an Inf amax saturate the scale, which zeroes the block's finite elements."""
    mag = blocks.abs()
    mag = torch.where(torch.isfinite(mag), mag, torch.zeros_like(mag))
    return mag.amax(dim=-1)


def quantize_mxfp8(x: torch.Tensor, axis: int = -1, scale_mode: str = "rceil") -> QTensor:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"mxfp8 scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    shape = x.shape
    moved = x.to(torch.float32)
    if axis != -1:
        moved = moved.movedim(axis, -1)
    n = moved.shape[-1]
    blocks_x = moved.reshape(*moved.shape[:-1], n // C.MXFP8_BLOCK, C.MXFP8_BLOCK)

    amax = block_amax(blocks_x)
    if scale_mode == "rceil":
        # §2.2 RCEIL: ceil_e8m0(a * fl(1/448)), as TE / FlashInfer / cuBLAS.
        code = codecs.ceil_e8m0(amax * C.RCP_448)
    else:
        code = codecs.floor_e8m0(amax, C.E4M3_EMAX)
    # §2.3: multiply by the exact power-of-two reciprocal, then RNE + saturate to E4M3 -- to
    # 240 instead of 448 at the top scale 2^120, where 256 x 2^120 would be +Inf (`e4m3_limit`).
    scaled = blocks_x * codecs.e8m0_reciprocal(code).unsqueeze(-1)
    limit = codecs.e4m3_limit(code).unsqueeze(-1)
    qdata = codecs.e4m3_encode(scaled, limit).reshape(moved.shape)
    if axis != -1:
        qdata = qdata.movedim(-1, axis)
        code = code.movedim(-1, axis)
    return QTensor(
        qdata=qdata.contiguous(),
        scale=code.contiguous().view(torch.float8_e8m0fnu),
        fmt=C.Format.MXFP8,
        shape=shape,
        axis=axis,
    )


def dequantize_mxfp8(q: QTensor) -> torch.Tensor:
    values = codecs.e4m3_decode(q.qdata)
    scale = codecs.e8m0_to_f32(q.scale)
    if q.axis != -1:
        values = values.movedim(q.axis, -1)
        scale = scale.movedim(q.axis, -1)
    blocks = values.reshape(*values.shape[:-1], -1, C.MXFP8_BLOCK)
    out = (blocks * scale.unsqueeze(-1)).reshape(values.shape)
    if q.axis != -1:
        out = out.movedim(-1, q.axis)
    return out.contiguous()
