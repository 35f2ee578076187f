"""QTensor: a quantized tensor as stored in checkpoints, weight sync and the engine.

Legend: x has logical shape [..., K] (K = the quantized, contiguous last dim unless `axis` says
otherwise). Scales are stored linear, one per block: `[..., K/block]` (spec §4: the 128x4 swizzle
is produced only for native GEMMs, by `swizzle_scales`).

| fmt       | qdata (uint8)                     | scale                                | global_scale          |
|-----------|-----------------------------------|--------------------------------------|-----------------------|
| mxfp8     | E4M3 bytes, x's shape             | float8_e8m0fnu, x's shape with the   | None                  |
|           |                                   | `axis` dim divided by 32             |                       |
| nvfp4     | E2M1 codes packed [..., K/2],     | float8_e4m3fn [..., K/16]            | fp32 encode scale     |
|           | even element in the low nibble    |                                      | S_enc: [] or [..., 1] |
| fp8_block | E4M3 bytes, x's shape             | float32 [..., ceil(R/br), K/bk]      | None                  |

Every field is a tensor or derivable from the tensors' shapes and dtypes, so a QTensor round-trips
through any safetensors file as three (or two) plain tensors: `to_state_dict` / `from_state_dict`.
`stored_layout` gives the dtype and shape of every field from the format, the logical shape, the
block and the NVFP4 global-scale granularity alone: what a receiver checks a QTensor against
before it trusts it (`QTensor.layout()` is the same for a QTensor in hand).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxrl.formats.constants import FP8_BLOCK_WEIGHT, MXFP8_BLOCK, NVFP4_BLOCK, Format

_SCALE_DTYPE = {
    Format.MXFP8: torch.float8_e8m0fnu,
    Format.NVFP4: torch.float8_e4m3fn,
    Format.FP8_BLOCK: torch.float32,
}
_FORMAT_OF_SCALE_DTYPE = {dtype: fmt for fmt, dtype in _SCALE_DTYPE.items()}
FIELDS = ("qdata", "scale", "global_scale")
# NVFP4 global scale granularity -> its shape for a logical shape [..., R, K]: one per tensor [],
# one per matrix of a stack ([E, 1, 1]: per expert), one per row ([..., R, 1]: per token, or a
# fused gate_up's two halves each repeated over its rows)
GLOBAL_SCALES = ("tensor", "matrix", "row")
FieldLayout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass(frozen=True, eq=False)
class QTensor:
    """A tensor quantized by `mxrl.formats.quantize`. See the module docstring for layouts."""

    qdata: torch.Tensor
    scale: torch.Tensor
    fmt: Format
    shape: torch.Size
    axis: int = -1
    global_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", Format(self.fmt))
        object.__setattr__(self, "shape", torch.Size(self.shape))
        if self.fmt is Format.BF16:
            raise ValueError("QTensor holds quantized formats only; bf16 tensors stay tensors")
        if self.qdata.dtype != torch.uint8:
            raise TypeError(f"QTensor.qdata must be uint8, got {self.qdata.dtype}")
        want = _SCALE_DTYPE[self.fmt]
        if self.scale.dtype != want:
            raise TypeError(f"{self.fmt} QTensor.scale must be {want}, got {self.scale.dtype}")
        packed = _packed_shape(self.fmt, self.shape)
        if tuple(self.qdata.shape) != packed:
            raise ValueError(
                f"{self.fmt} QTensor of shape {tuple(self.shape)} needs qdata of shape "
                f"{packed}, got {tuple(self.qdata.shape)}"
            )
        if (self.global_scale is None) != (self.fmt is not Format.NVFP4):
            raise ValueError("global_scale is required for nvfp4 and absent for other formats")
        gs = self.global_scale
        if gs is not None and gs.dtype != torch.float32:
            raise TypeError(f"global_scale must be float32, got {gs.dtype}")
        if gs is not None and gs.dim() not in (0, len(self.shape)):
            raise ValueError(
                f"global_scale of shape {tuple(gs.shape)} must be [] or of rank {len(self.shape)}"
            )
        if self.axis != -1 and self.fmt is not Format.MXFP8:
            raise ValueError(f"axis={self.axis}: only mxfp8 has column-wise copies")

    # --- derived ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.qdata.device

    @property
    def per_token(self) -> bool:
        """NVFP4 with one global scale per row (token): global_scale of shape [..., 1]."""
        gs = self.global_scale
        return gs is not None and gs.dim() > 0 and tuple(gs.shape) == (*self.shape[:-1], 1)

    @property
    def block(self) -> tuple[int, int]:
        """(rows, cols) of one scale block over the last two dims of the logical tensor."""
        if self.fmt is Format.MXFP8:
            return (MXFP8_BLOCK, 1) if self.axis != -1 else (1, MXFP8_BLOCK)
        if self.fmt is Format.NVFP4:
            return (1, NVFP4_BLOCK)
        k = self.shape[-1]
        block_k = k // self.scale.shape[-1]
        rows = self.shape[-2] if len(self.shape) >= 2 else 1
        block_rows = 1 if self.scale.dim() < 2 or self.scale.shape[-2] == rows else block_k
        return (block_rows, block_k)

    @property
    def nbytes(self) -> int:
        """Bytes held: data, block scales and global scales."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def dequantize(self) -> torch.Tensor:
        from mxrl.formats.api import dequantize

        return dequantize(self)

    def to(self, device: torch.device | str) -> QTensor:
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return QTensor(
            self.qdata.to(device), self.scale.to(device), self.fmt, self.shape, self.axis, gs
        )

    def layout(self) -> FieldLayout:
        """Every stored field's (dtype, shape), by name: what `stored_layout` predicts."""
        return {k: (t.dtype, tuple(t.shape)) for k, t in self.tensors().items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored fields by name (qdata, scale and, for nvfp4, global_scale)."""
        out = {"qdata": self.qdata, "scale": self.scale}
        if self.global_scale is not None:
            out["global_scale"] = self.global_scale
        return out

    # --- serialisation ------------------------------------------------------------------------
    def to_state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """`{prefix}.qdata`, `{prefix}.scale` (and `{prefix}.global_scale`), contiguous."""
        return {f"{prefix}.{k}": v.contiguous() for k, v in self.tensors().items()}

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, torch.Tensor], prefix: str) -> QTensor:
        """Rebuild a QTensor written by `to_state_dict(prefix)`; format, shape and axis come
        from the tensors themselves (scale dtype, qdata shape, which dim the scale blocks)."""
        try:
            qdata = state_dict[f"{prefix}.qdata"]
            scale = state_dict[f"{prefix}.scale"]
        except KeyError as err:
            raise KeyError(
                f"no QTensor under prefix {prefix!r}: missing {err.args[0]!r}; "
                "was it written with QTensor.to_state_dict?"
            ) from None
        global_scale = state_dict.get(f"{prefix}.global_scale")
        fmt = _FORMAT_OF_SCALE_DTYPE.get(scale.dtype)
        if fmt is None:
            raise TypeError(f"{prefix}.scale has dtype {scale.dtype}, which no format uses")
        if fmt is Format.NVFP4:
            shape = torch.Size((*qdata.shape[:-1], qdata.shape[-1] * 2))
        else:
            shape = qdata.shape
        axis = _infer_axis(qdata.shape, scale.shape) if fmt is Format.MXFP8 else -1
        return cls(qdata, scale, fmt, shape, axis, global_scale)


def stored_layout(
    fmt: Format | str,
    shape: tuple[int, ...],
    *,
    axis: int = -1,
    block: tuple[int, int] | None = None,
    global_scale: str = "tensor",
) -> FieldLayout:
    """(dtype, shape) of every field a QTensor of `fmt` and logical `shape` stores (the module
    docstring's table), in `tensors()` order: the one derivation of a quantized tensor's layout.

    axis: MXFP8's blocked dim (-1 row-wise; another dim for a column-wise copy). block: block
    FP8's (rows, cols), (128, 128) when None. global_scale: NVFP4's granularity, one of
    GLOBAL_SCALES. Raises ValueError for a shape the format cannot block."""
    fmt = Format(fmt)
    shape = tuple(int(d) for d in shape)
    if fmt is Format.BF16 or not shape:
        raise ValueError(f"stored_layout: {fmt} of shape {shape} is not a quantized tensor")
    k = shape[-1]
    if fmt is Format.MXFP8:
        dim = axis % len(shape)
        if shape[dim] % MXFP8_BLOCK:
            raise ValueError(f"mxfp8: dim {dim} of {shape} is not a multiple of {MXFP8_BLOCK}")
        scale = tuple(n // MXFP8_BLOCK if d == dim else n for d, n in enumerate(shape))
        return {"qdata": (torch.uint8, shape), "scale": (torch.float8_e8m0fnu, scale)}
    if axis != -1:
        raise ValueError(f"axis={axis}: only mxfp8 has column-wise copies")
    if fmt is Format.NVFP4:
        if k % NVFP4_BLOCK:
            raise ValueError(f"nvfp4: K={k} of {shape} is not a multiple of {NVFP4_BLOCK}")
        if global_scale not in GLOBAL_SCALES:
            raise ValueError(f"global_scale must be one of {GLOBAL_SCALES}, got {global_scale!r}")
        if global_scale == "matrix" and len(shape) < 2:
            raise ValueError(f"nvfp4: a 'matrix' global scale needs a 2-D or larger shape {shape}")
        gs = {
            "tensor": (),
            "matrix": (*shape[:-2], 1, 1),
            "row": (*shape[:-1], 1),
        }[global_scale]
        return {
            "qdata": (torch.uint8, (*shape[:-1], k // 2)),
            "scale": (torch.float8_e4m3fn, (*shape[:-1], k // NVFP4_BLOCK)),
            "global_scale": (torch.float32, gs),
        }
    br, bk = block if block is not None else FP8_BLOCK_WEIGHT
    if k % bk or (br > 1 and len(shape) < 2):
        raise ValueError(f"fp8_block: block {(br, bk)} does not tile {shape}")
    if br == 1:
        scale = (*shape[:-1], k // bk)
    else:
        scale = (*shape[:-2], -(-shape[-2] // br), k // bk)
    return {"qdata": (torch.uint8, shape), "scale": (torch.float32, scale)}


def _packed_shape(fmt: Format, shape: torch.Size) -> tuple[int, ...]:
    if fmt is Format.NVFP4:
        return (*shape[:-1], shape[-1] // 2)
    return tuple(shape)


def _infer_axis(data_shape: torch.Size, scale_shape: torch.Size) -> int:
    if len(data_shape) != len(scale_shape):
        raise ValueError(
            f"mxfp8 qdata {tuple(data_shape)} and scale {tuple(scale_shape)} differ in rank"
        )
    blocked = [d for d, (n, s) in enumerate(zip(data_shape, scale_shape, strict=True)) if n != s]
    if blocked == [len(data_shape) - 1] or not blocked:
        return -1
    if len(blocked) != 1:
        raise ValueError(f"mxfp8 scale {tuple(scale_shape)} does not fit qdata {tuple(data_shape)}")
    return blocked[0]
