"""NVFP4 reference quantizer: E2M1 elements, E4M3 scale per 16, FP32 global scale (spec §3).

Legend: x_hp [..., K]; blocks of 16 along K. The global scale is the FP32 *encode* scale
S_enc = fl(2688 / amax) (§3.2), one per tensor (shape []) or one per row/token (shape [..., 1],
§3.6), so a token's bytes never depend on the other tokens of the batch.

Operation order is TransformerEngine's (§3.3), each step one fp32 op:
  t      = fl(b_amax * fl(S_enc * fl(1/6)))       block scale, before the E4M3 cast
  s      = E4M3_satfinite(min(t, FLT_MAX))
  enc    = min(fl(1 / fl(s * S_dec)), FLT_MAX)    S_dec = fl(1 / S_enc)
  q      = E2M1_satfinite(fl(x * enc))
`scale_mode="4over6"` (docs/formats.md, "NVFP4 4over6"): the same S_enc and the same steps for
two candidates per block, the one above (block amax -> 6) and one with fl(1/4) in place of
fl(1/6) (block amax -> 4; its t past 448 saturates to 448 as any E4M3 cast does), and keeps the
block whose squared error is lower, measured in the encoded domain (`_block_sse`); a tie keeps 6.
`scale_mode="torchao"` reproduces torchao's `nvfp4_quantize` instead (two divisions, block scale
clamped to [2^-6, 448], §3.4-§3.5): for comparison only.

Non-finite inputs (docs/formats.md, "Non-finite inputs"): E2M1 holds neither NaN nor Inf, so the
block's E4M3 scale carries it. Every amax (block, per token, per tensor) is over the finite
elements only, and every step above runs as if NaN/Inf were 0 for the scales; then a 16-element
block holding any NaN/±Inf gets scale byte 0x7F (E4M3 NaN): all 16 elements dequantize to NaN.
Its element codes are the normal encoding with the finite scale (NaN -> 0x7, ±Inf -> ±6, finite
elements as if the bad one were 0); other blocks and the global scale are untouched.
"""

from __future__ import annotations

import math

import torch

from mxrl.formats import codecs
from mxrl.formats import constants as C
from mxrl.formats.mxfp8 import block_amax
from mxrl.formats.qtensor import QTensor

SCALE_MODES = ("te", "4over6", "torchao")
_E4M3_TINY = 2.0**-6  # torch.finfo(float8_e4m3fn).tiny: torchao's lower clamp (§3.4)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = fl(2688 / amax) with the §3.2 edge rules: 0 or Inf amax -> 1; capped at FLT_MAX.
    (The amaxes quantize computes are finite, and a caller's global_amax must be: the Inf rule
    is kept for the spec's sake.)"""
    s_enc = codecs.fdiv(C.NVFP4_GLOBAL_NUMERATOR, amax)
    s_enc = torch.clamp(s_enc, max=C.FLT_MAX)
    bad = (amax == 0) | (s_enc == 0)
    return torch.where(bad, torch.ones_like(s_enc), s_enc)


def caller_amax(
    global_amax,
    shape: torch.Size,
    device: torch.device,
    check: bool = True,
    data_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """A scalar (one scale for the tensor) or a tensor of x's rank whose last dim is 1 and which
    broadcasts over x's leading dims (one scale per row, per expert [E, 1, 1], ...).

    check: refuse a value that is NaN, Inf or negative, and, given `data_amax` (x's finite
    magnitudes, or its block amaxes: any tensor of x's rank whose max over a scale's group is
    that group's amax), one below its data: 0 for data that is not all zero, or so far below
    that the E4M3 block scales would saturate, clipping the data (docs/formats.md). One read
    back to the host for both (on a GPU, a sync); check=False (`check_amax=False` of
    `quantize`) is for an amax the caller computed itself (`weight_amax`), and skips both."""
    g = torch.as_tensor(global_amax, dtype=torch.float32, device=device)
    fits = g.dim() == 0 or (
        g.dim() == len(shape)
        and g.shape[-1] == 1
        and all(a in (1, b) for a, b in zip(g.shape[:-1], shape[:-1], strict=True))
    )
    if not fits:
        raise ValueError(
            f"nvfp4: global_amax of shape {tuple(g.shape)} does not fit x of shape {tuple(shape)}; "
            "pass a scalar, or a tensor of x's rank with last dim 1 (e.g. [rows, 1] or [E, 1, 1])"
        )
    if check:
        _check_caller_amax(g, data_amax)
    return g


def _check_caller_amax(g: torch.Tensor, data_amax: torch.Tensor | None) -> None:
    bad = ~torch.isfinite(g) | (g < 0)
    if data_amax is None:
        group_amax = torch.full_like(g, math.inf)  # unknown: a 0 amax is refused
        clipped = ~bad & (g == 0)
    else:  # TE order: the largest block scale of each group is that of its amax (§3.3)
        group_amax = _group_max(data_amax, g)
        t = group_amax * (global_encode_scale(g) * C.RCP_6)
        # 0 is the amax of an all-zero group (S_enc = 1, §3.2); for any other data it is a
        # missing amax, which would quantize it without a scale (tiny values to 0)
        below = (g == 0) & (group_amax > 0)
        clipped = ~bad & ((t > C.E4M3_SATURATION_EDGE) | below)
    flags = int((bad.any().to(torch.int32) + 2 * clipped.any().to(torch.int32)).item())
    if flags & 1:  # (one read back for both checks)
        first = _first_index(bad, g.shape)
        raise ValueError(
            f"nvfp4: global_amax must be finite and non-negative; it holds {g[first].item()} at "
            f"index {first}. A NaN/Inf amax means the tensor it came from holds NaN/Inf: take "
            "the amax over its finite elements, or find what produced them (check_finite=True "
            "on that tensor names the first one)"
        )
    if flags & 2:
        first = _first_index(clipped, g.shape)  # group_amax and clipped have g's shape
        value, amax = f"{g[first].item():.6g}", f"{group_amax[first].item():.6g}"
        harm = (
            "a 0 amax stands for all-zero data (S_enc = 1), so this data would be quantized "
            "without its scale (small values to 0, large ones clipped)"
            if g[first].item() == 0
            else f"the E4M3 block scales would saturate and clip the data to about ±{value}"
        )
        raise ValueError(
            f"nvfp4: global_amax {value} at index {first} is below the amax of the data it "
            f"scales, {amax}: {harm}. Pass the max |x| over every tensor sharing the scale "
            "(gate and up: the max of both), or global_amax=None to use x's own"
        )


def _group_max(data_amax: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """data_amax (x's rank) reduced to g's groups: over every dim where g has 1 (all of them
    for a scalar g)."""
    if g.dim() == 0:
        return data_amax.amax()
    dims = tuple(i for i in range(g.dim()) if g.shape[i] == 1)
    return data_amax.amax(dim=dims, keepdim=True)


def _first_index(mask: torch.Tensor, shape: torch.Size) -> tuple[int, ...]:
    """The index of mask's first True (() for a 0-d mask)."""
    if mask.dim() == 0:
        return ()
    flat = mask.reshape(-1).nonzero()[0]
    return tuple(int(i) for i in torch.unravel_index(flat, shape))


def quantize_nvfp4(
    x: torch.Tensor,
    per_token: bool = False,
    global_amax: torch.Tensor | float | None = None,
    scale_mode: str = "te",
    check_amax: bool = True,
) -> QTensor:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"nvfp4 scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if per_token and global_amax is not None:
        raise ValueError(
            "nvfp4: per_token=True computes one amax per row; global_amax cannot be combined "
            "with it (pass one or the other)"
        )
    shape = x.shape
    xf = x.to(torch.float32)
    k = shape[-1]
    blocks_x = xf.reshape(*shape[:-1], k // C.NVFP4_BLOCK, C.NVFP4_BLOCK)
    b_amax = block_amax(blocks_x)  # [..., K/16]

    if per_token:
        g_amax = b_amax.amax(dim=-1, keepdim=True)  # [..., 1]
    elif global_amax is not None:
        g_amax = caller_amax(global_amax, shape, x.device, check=check_amax, data_amax=b_amax)
    else:
        g_amax = b_amax.amax() if b_amax.numel() else torch.zeros((), device=x.device)
    s_enc = global_encode_scale(g_amax)

    if scale_mode in ("te", "4over6"):
        s_dec = codecs.fdiv(1.0, s_enc)
        scale_codes, s_block, enc = _te_block_scale(b_amax, s_enc, s_dec, C.RCP_6)
    else:
        # torchao nvfp4_quantize(per_tensor_scale = amax / (448 * 6)), §3.5; its decode scale is
        # kept as-is and stored as 1/decode so that dequantize reads one field for both modes.
        per_tensor_scale = codecs.fdiv(g_amax, C.E4M3_MAX * C.E2M1_MAX)
        block = codecs.fdiv(codecs.fdiv(b_amax, C.E2M1_MAX), per_tensor_scale)
        block = torch.clamp(block, min=_E4M3_TINY, max=C.E4M3_MAX)
        scale_codes = codecs.e4m3_encode(block)
        s_block = codecs.e4m3_decode(scale_codes)
        enc = codecs.fdiv(codecs.fdiv(1.0, per_tensor_scale), s_block)
        s_enc = codecs.fdiv(1.0, per_tensor_scale)

    scaled = blocks_x * enc.unsqueeze(-1)
    if scale_mode == "torchao":
        scaled = torch.clamp(scaled, -C.E2M1_MAX, C.E2M1_MAX)
    codes = codecs.e2m1_encode(scaled)
    if scale_mode == "4over6":
        scale_codes, codes = _four_over_six(blocks_x, b_amax, s_enc, s_dec, codes, scale_codes)
    codes = codes.reshape(shape)
    # A block holding NaN/Inf: its scale byte becomes E4M3 NaN (module docstring).
    block_bad = ~torch.isfinite(blocks_x).all(dim=-1)
    scale_codes = torch.where(block_bad, torch.full_like(scale_codes, C.E4M3_NAN_CODE), scale_codes)
    return QTensor(
        qdata=codecs.pack_nibbles(codes).contiguous(),
        scale=scale_codes.contiguous().view(torch.float8_e4m3fn),
        fmt=C.Format.NVFP4,
        shape=shape,
        global_scale=s_enc.to(torch.float32).contiguous(),
    )


def _te_block_scale(
    b_amax: torch.Tensor, s_enc: torch.Tensor, s_dec: torch.Tensor, per_amax: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 scale bytes, their values, the element multiplier enc) of every block, in TE order
    (§3.3): per_amax = fl(1/6) maps the block amax to 6 (the standard), 1/4 maps it to 4."""
    t = b_amax * (s_enc * per_amax)
    t = torch.clamp(t, max=C.FLT_MAX)
    scale_codes = codecs.e4m3_encode(t)
    s_block = codecs.e4m3_decode(scale_codes)
    enc = codecs.fdiv(1.0, s_block * s_dec)
    return scale_codes, s_block, torch.clamp(enc, max=C.FLT_MAX)


def _four_over_six(
    blocks_x: torch.Tensor,
    b_amax: torch.Tensor,
    s_enc: torch.Tensor,
    s_dec: torch.Tensor,
    codes_6: torch.Tensor,
    scale_6: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """4over6 (module docstring): the map-to-4 candidate of every block beside the standard one
    (`scale_6`, `codes_6`), and per block the one of lower `_block_sse` (ties: 6). Returns
    (scale bytes [..., K/16], codes [..., K/16, 16])."""
    scale_4, s_block_4, enc_4 = _te_block_scale(b_amax, s_enc, s_dec, C.RCP_4)
    codes_4 = codecs.e2m1_encode(blocks_x * enc_4.unsqueeze(-1))
    u = blocks_x * (s_enc.unsqueeze(-1) if s_enc.dim() else s_enc)
    finite = torch.isfinite(blocks_x)
    s_block_6 = codecs.e4m3_decode(scale_6)
    pick_4 = _block_sse(codes_4, s_block_4, u, finite) < _block_sse(codes_6, s_block_6, u, finite)
    scale = torch.where(pick_4, scale_4, scale_6)
    return scale, torch.where(pick_4.unsqueeze(-1), codes_4, codes_6)


def _block_sse(
    codes: torch.Tensor, s_block: torch.Tensor, u: torch.Tensor, finite: torch.Tensor
) -> torch.Tensor:
    """Sum over each 16-block of fl(d * d), d = fl(e2m1 * s_block - u), u = fl(x * S_enc): the
    squared error of the dequantized block times S_enc^2 (a factor common to both candidates),
    on a scale that does not move with the tensor's (|u| <= ~2688 for its own amax: no square
    overflows, and only those of elements ~1e-19 below the amax go subnormal, IEEE in the
    reference and the kernels alike). e2m1 * s_block is exact (<= 6 significant bits), so an FMA contraction
    in a kernel cannot change d. A NaN/Inf element counts as 0 (d = 0: what a 0 there gives),
    so its block decides as if it were 0. The 16 squares add as a pairwise tree of adjacent
    pairs, ((d0^2 + d1^2) + (d2^2 + d3^2)) + ..., the order the kernel adds them in."""
    p = codecs.e2m1_decode(codes) * s_block.unsqueeze(-1)
    d = p - u
    d = torch.where(finite, d, torch.zeros_like(d))
    sq = d * d
    while sq.shape[-1] > 1:
        sq = sq[..., 0::2] + sq[..., 1::2]
    return sq.squeeze(-1)


def dequantize_nvfp4(q: QTensor, global_scale: bool = True) -> torch.Tensor:
    """x_hat = fl(fl(e2m1 * s_block) * S_dec), S_dec = fl(1 / S_enc); without the last factor
    when global_scale=False (e2m1 * s_block is exact in fp32)."""
    values = codecs.e2m1_decode(codecs.unpack_nibbles(q.qdata))
    blocks = values.reshape(*values.shape[:-1], -1, C.NVFP4_BLOCK)
    s_block = codecs.e4m3_decode(q.scale).unsqueeze(-1)
    scaled = blocks * s_block
    if global_scale:
        s_dec = codecs.fdiv(1.0, q.global_scale)
        if s_dec.dim():
            s_dec = s_dec.unsqueeze(-1)  # [..., 1] -> [..., 1, 1] over (blocks, elements)
        scaled = scaled * s_dec
    return scaled.reshape(q.shape)
