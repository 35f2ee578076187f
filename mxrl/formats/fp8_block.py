"""DeepSeek-V3-style block FP8 (spec §5): E4M3 elements, one FP32 scale per block.

Blocks: (128, 128) for weights [..., N, K] (over the last two dims; a partial last row-block is
allowed, its amax taken over the rows that exist, which equals zero padding) and (1, 128) for
activations [..., K] (per token). The reference is DeepGEMM's `per_block_cast_to_fp8` /
`per_token_cast_to_fp8`, the maintained one (§5.2):
  a  = max(amax, 1e-4);  sf = fl(a / 448)   [scale_mode="ue8m0": sf rounded up to 2^k, §5.1]
  q  = E4M3_satfinite(fl(x * fl(1 / sf)))
Stored scale = sf (the *decode* scale, DeepSeek's `weight_scale_inv`); x_hat = fl(E4M3(q) * sf).
Non-finite inputs: amax is over the block's finite elements (`block_amax`), and a NaN or ±Inf
element is stored as the E4M3 NaN byte 0x7F (`codecs.e4m3_encode`): it dequantizes to NaN, the
scale and the other elements are those of the block with that element 0 (docs/formats.md).
Finite inputs dequantize to finite values: with ue8m0 scales a block with amax above ~2.98e38
gets 2^120, where elements saturate to ±240 instead of rounding to ±256 (= ±Inf once scaled), as
MXFP8 (`codecs.e4m3_limit`); fp32 scales need no cap (448 x fl(amax / 448) never overflows).
"""

from __future__ import annotations

import torch

from mxrl.formats import codecs
from mxrl.formats import constants as C
from mxrl.formats.mxfp8 import block_amax
from mxrl.formats.qtensor import QTensor

SCALE_MODES = ("fp32", "ue8m0")


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """[..., R, K] -> [..., R/br, K/bk, br*bk] (rows zero-padded to a multiple of br)."""
    br, bk = block
    if br == 1:
        return x.reshape(*x.shape[:-1], x.shape[-1] // bk, bk), 0
    rows, k = x.shape[-2], x.shape[-1]
    pad = (-rows) % br
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    lead = x.shape[:-2]
    view = x.reshape(*lead, (rows + pad) // br, br, k // bk, bk)
    return view.transpose(-3, -2).reshape(*lead, (rows + pad) // br, k // bk, br * bk), pad


def _unblocked(blocks: torch.Tensor, block: tuple[int, int], shape: torch.Size, pad: int):
    br, bk = block
    if br == 1:
        return blocks.reshape(shape)
    lead = blocks.shape[:-3]
    nr, nk = blocks.shape[-3], blocks.shape[-2]
    full = blocks.reshape(*lead, nr, nk, br, bk).transpose(-3, -2).reshape(*lead, nr * br, nk * bk)
    return full[..., : full.shape[-2] - pad, :] if pad else full


def quantize_fp8_block(
    x: torch.Tensor, block: tuple[int, int] = C.FP8_BLOCK_WEIGHT, scale_mode: str = "fp32"
) -> QTensor:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"fp8_block scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    shape = x.shape
    blocks_x, pad = _blocked(x.to(torch.float32), block)
    amax = torch.clamp(block_amax(blocks_x), min=C.FP8_BLOCK_AMAX_FLOOR)
    sf = codecs.fdiv(amax, C.E4M3_MAX)
    limit = None  # fp32 scales: 448 x sf is finite for every finite amax (docs/formats.md)
    if scale_mode == "ue8m0":
        code = torch.clamp(codecs.ceil_e8m0(sf), 1, C.E8M0_MAX_CODE)
        sf = codecs.e8m0_to_f32(code)
        limit = codecs.e4m3_limit(code).unsqueeze(-1)  # 240 at 2^120, as MXFP8
    qdata = codecs.e4m3_encode(blocks_x * codecs.fdiv(1.0, sf).unsqueeze(-1), limit)
    return QTensor(
        qdata=_unblocked(qdata, block, shape, pad).contiguous(),
        scale=sf.contiguous(),
        fmt=C.Format.FP8_BLOCK,
        shape=shape,
    )


def dequantize_fp8_block(q: QTensor) -> torch.Tensor:
    block = q.block
    br, bk = block
    values = codecs.e4m3_decode(q.qdata)
    if br > 1 and values.shape[-2] % br == 0:  # br > 1: x has rows (a (1, b) x may be 1-D)
        # the same products without the block transposes: [.., R/br, br, K/bk, bk] x scale
        lead, (rows, k) = values.shape[:-2], values.shape[-2:]
        view = values.reshape(*lead, rows // br, br, k // bk, bk)
        return (view * q.scale[..., :, None, :, None]).reshape(values.shape)
    blocks, pad = _blocked(values, block)
    return _unblocked(blocks * q.scale.unsqueeze(-1), block, q.shape, pad)


def transpose_square_blocks(q: QTensor) -> QTensor:
    """The fp8_block QTensor of w^T [..., K, N] from that of w [..., N, K] in square b x b
    blocks, N and K multiples of b: a square block of w^T holds the same elements as the
    block of w it mirrors, so it has the same amax, the same scale and the same codes — this
    is `quantize_fp8_block(w^T, (b, b))` byte for byte, without the master weight. (The
    quantized backward's dgrad reads w along N, its forward along K: one copy serves both,
    which is why DeepSeek-V3 quantizes weights in 128x128 blocks.)"""
    br, bk = q.block
    rows, k = q.shape[-2], q.shape[-1]
    if q.fmt is not C.Format.FP8_BLOCK or br != bk or rows % br or k % bk:
        raise ValueError(
            f"transpose_square_blocks takes an fp8_block QTensor in square blocks whose last "
            f"two dims are multiples of the block, got {q.fmt} {tuple(q.shape)} in {q.block}"
        )
    shape = (*q.shape[:-2], k, rows)
    return QTensor(
        qdata=q.qdata.transpose(-2, -1).contiguous(),
        scale=q.scale.transpose(-2, -1).contiguous(),
        fmt=C.Format.FP8_BLOCK,
        shape=shape,
    )
