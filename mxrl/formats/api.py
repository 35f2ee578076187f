"""The public entry points: `quantize`, `dequantize` (spec §2-§5 through one door)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from mxrl.formats import codecs
from mxrl.formats import constants as C
from mxrl.formats.fp8_block import dequantize_fp8_block, quantize_fp8_block
from mxrl.formats.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from mxrl.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from mxrl.formats.qtensor import QTensor

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DEFAULT_SCALE_MODE = {C.Format.MXFP8: "rceil", C.Format.NVFP4: "te", C.Format.FP8_BLOCK: "fp32"}


@dataclass(frozen=True)
class QuantizeOptions:
    """The quantizer's argument list, spelled once: `quantize` below takes these keywords and
    `mxrl.kernels.quantize` builds this record from them (its docstring says what each does).
    Nothing is checked here: whether an option is allowed depends on the format and the tensor,
    so `check_request` checks it against both, with the messages `quantize` has always given."""

    axis: int = -1
    scale_mode: str | None = None
    per_token: bool = False
    global_amax: torch.Tensor | float | None = None
    block: tuple[int, int] | None = None
    check_finite: bool = False
    check_amax: bool = True

    def kwargs(self) -> dict[str, Any]:
        """The options as `quantize`'s keywords (the values themselves, not copies)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_request(x: torch.Tensor, fmt: C.Format | str, options: QuantizeOptions) -> C.Format:
    """The quantized format `fmt` names, once the request is one the quantizer takes: x a
    floating tensor of a shape the format blocks, the options the format's own, and with
    `check_finite` no NaN/Inf in x. Raises TypeError / ValueError naming what to change."""
    parsed = _parse_format(fmt)
    o = options
    _check_input(x, parsed, o.axis, o.per_token, o.global_amax, o.block)
    if o.check_finite:
        _raise_if_not_finite(x, parsed)
    return parsed


def quantize(
    x: torch.Tensor,
    fmt: C.Format | str,
    *,
    axis: int = -1,
    scale_mode: str | None = None,
    per_token: bool = False,
    global_amax: torch.Tensor | float | None = None,
    block: tuple[int, int] | None = None,
    check_finite: bool = False,
    check_amax: bool = True,
) -> QTensor:
    """Quantize `x` ([..., K], fp32/bf16/fp16, any device) to `fmt`.

    fmt="mxfp8": 1x32 blocks along the last dim (`axis=0` for the column-wise 32x1 copy of a
      2-D tensor; any dim works); scale_mode "rceil" (default) or "floor" (OCP, comparison only).
    fmt="nvfp4": 1x16 blocks, E4M3 block scale and one FP32 global encode scale per tensor, or
      per row with `per_token=True`, or from a caller's `global_amax` (gate+up share one): a
      scalar, or a tensor of x's rank with last dim 1 (per row, or per expert as [E, 1, 1]).
      scale_mode "te" (default), "4over6" (per block, the block amax mapped to 6 or to 4,
      whichever block has the lower squared error: docs/formats.md, "NVFP4 4over6"; the same
      layout and global scale, any NVFP4 consumer reads it) or "torchao" (comparison only).
      A `global_amax` holding NaN/Inf or a negative value is refused, and so is one below the
      amax of the data it scales: 0 for data that is not all zero, or so far below that the
      E4M3 block scales would saturate and clip it (an amax more than ~3.6% above it; one read
      back to the host for all: on a GPU a sync). `check_amax=False` skips these for an amax
      the caller computed itself (`mxrl.recipe.quantize.weight_amax`), with no effect on the
      bytes.
    fmt="fp8_block": `block=(128, 128)` (default; weights, over the last two dims) or `(1, 128)`
      (activations); scale_mode "fp32" (default) or "ue8m0" (power-of-two scales).
    check_finite=True raises on NaN/Inf, naming their count and the first index and value.
    Otherwise a NaN/±Inf input comes out NaN, and its block's finite elements keep the bytes
    they would have were it 0: every amax is over the finite elements; MXFP8 and block FP8 store
    the element as the E4M3 NaN byte 0x7F; NVFP4 (E2M1 has no NaN) sets its 16-element block's
    scale to 0x7F, so that whole block dequantizes to NaN (docs/formats.md, "Non-finite inputs").
    A tensor with a zero-size dimension is refused (there is nothing to quantize).
    """
    options = QuantizeOptions(
        axis=axis,
        scale_mode=scale_mode,
        per_token=per_token,
        global_amax=global_amax,
        block=block,
        check_finite=check_finite,
        check_amax=check_amax,
    )
    fmt = check_request(x, fmt, options)
    mode = scale_mode if scale_mode is not None else _DEFAULT_SCALE_MODE[fmt]
    if fmt is C.Format.MXFP8:
        ndim = x.dim()
        axis = -1 if axis in (-1, ndim - 1) else axis % ndim
        return quantize_mxfp8(x, axis=axis, scale_mode=mode)
    if fmt is C.Format.NVFP4:
        return quantize_nvfp4(
            x, per_token=per_token, global_amax=global_amax, scale_mode=mode, check_amax=check_amax
        )
    return quantize_fp8_block(x, block=block or C.FP8_BLOCK_WEIGHT, scale_mode=mode)


def dequantize(q: QTensor, *, global_scale: bool = True) -> torch.Tensor:
    """float32 tensor of q's logical shape.

    global_scale=False leaves out NVFP4's FP32 second-level scale (values e2m1 * s_block): the
    operand of the exact emulated GEMM (DESIGN.md §2), whose output is then multiplied by the
    decode scales `decode_global_scale(q)`. Other formats have no global scale.
    """
    if q.fmt is C.Format.MXFP8:
        return dequantize_mxfp8(q)
    if q.fmt is C.Format.NVFP4:
        return dequantize_nvfp4(q, global_scale=global_scale)
    return dequantize_fp8_block(q)


def decode_global_scale(q: QTensor) -> torch.Tensor | None:
    """NVFP4's FP32 decode scale S_dec = fl(1 / S_enc) (shape of `q.global_scale`); else None."""
    if q.global_scale is None:
        return None
    return codecs.fdiv(1.0, q.global_scale)


def _parse_format(fmt: C.Format | str) -> C.Format:
    try:
        parsed = C.Format(fmt)
    except ValueError:
        names = ", ".join(f.value for f in C.QUANTIZED_FORMATS)
        raise ValueError(f"unknown format {fmt!r}; quantized formats are: {names}") from None
    if parsed is C.Format.BF16:
        raise ValueError("bf16 is not a quantized format: cast with x.to(torch.bfloat16)")
    return parsed


def _check_input(x, fmt, axis, per_token, global_amax, block) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"quantize({fmt}) takes float32, bfloat16 or float16, got {x.dtype}")
    shape = tuple(x.shape)
    if x.dim() == 0:
        raise ValueError(f"quantize({fmt}) needs at least one dimension, got shape {shape}")
    if fmt is not C.Format.NVFP4 and (per_token or global_amax is not None):
        raise ValueError(f"per_token and global_amax are nvfp4 options, not {fmt}")
    if fmt is not C.Format.FP8_BLOCK and block is not None:
        raise ValueError(f"block= is an fp8_block option; {fmt} has a fixed block")
    if fmt is not C.Format.MXFP8 and axis != -1:
        raise ValueError(
            f"axis={axis}: only mxfp8 has column-wise copies; transpose the tensor for {fmt}"
        )
    if block is not None and not _is_block_pair(block):
        raise ValueError(
            f"fp8_block block must be a pair of positive ints (rows, cols), (1, b) or (b, b), "
            f"got {block!r}; e.g. block=(128, 128) for weights, (1, 128) for activations"
        )
    if x.numel() == 0:
        raise ValueError(
            f"quantize({fmt}): x has shape {shape}, with a zero-size dimension: there is nothing "
            "to quantize. Skip the call for an empty batch (an expert that got no tokens)."
        )

    if fmt is C.Format.MXFP8:
        if not -x.dim() <= axis < x.dim():
            raise ValueError(f"axis={axis} is out of range for shape {shape}")
        n, blk = shape[axis], C.MXFP8_BLOCK
        where = "last dimension" if axis in (-1, x.dim() - 1) else f"dimension {axis}"
        if n % blk:
            raise ValueError(
                f"mxfp8 blocks 32 elements along the {where}; shape {shape} has {n} there, not a "
                f"multiple of {blk}. Pad it, or keep this tensor in bf16 in the recipe."
            )
    elif fmt is C.Format.NVFP4:
        if shape[-1] % C.NVFP4_BLOCK:
            raise ValueError(
                f"nvfp4 blocks 16 elements along the last dimension; shape {shape} has K="
                f"{shape[-1]}, not a multiple of 16. Pad K, or keep this tensor in bf16."
            )
    else:
        br, bk = block or C.FP8_BLOCK_WEIGHT
        if br < 1 or bk < 1 or (br != 1 and br != bk):
            raise ValueError(f"fp8_block block must be (1, b) or (b, b), got {block}")
        if br > 1 and x.dim() < 2:
            raise ValueError(
                f"fp8_block block {(br, bk)} needs a 2-D (or more) tensor, got {shape}"
            )
        if shape[-1] % bk:
            raise ValueError(
                f"fp8_block block {(br, bk)} needs the last dimension to be a multiple of {bk}; "
                f"shape {shape} has K={shape[-1]}. Pad K, or keep this tensor in bf16."
            )


def _is_block_pair(block) -> bool:
    return (
        isinstance(block, (tuple, list))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    )


def _raise_if_not_finite(x: torch.Tensor, fmt: C.Format) -> None:
    bad = ~torch.isfinite(x)
    num_bad = int(bad.sum())
    if num_bad:
        flat = int(bad.reshape(-1).nonzero()[0])
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), x.shape))
        raise ValueError(
            f"quantize({fmt}): input of shape {tuple(x.shape)} holds {num_bad} non-finite "
            f"value(s) (NaN/Inf); first at index {index} = {x[index].item()}. Fix what produced "
            "it, or pass check_finite=False to quantize it anyway (NaN/Inf then dequantize to "
            "NaN: docs/formats.md, non-finite inputs)."
        )
