"""Batch-invariant token tiling, the engine's GEMMs' fixed shapes (docs/engine.md): `tiled`
runs a function on slices of exactly `tile` rows (the last one zero-padded), so each kernel it
launches sees the same shapes whatever else is in the batch, and a row's result cannot depend on
the other rows (`mxrl.nn.paths.rollout`). `one_group` is the one-launch alternative of the
engine's `dense_gemm="grouped"` (a bf16 projection's rows in one `_grouped_mm` launch)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mxrl.kernels.backend import tensor_cores_available


def tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int) -> torch.Tensor:
    """fn applied to [tile, ...] slices of x [T, ...] (zero-padded), results concatenated;
    tile 0: fn(x) at once (the engine's batch_invariant=False mode)."""
    if tile == 0:
        return fn(x)
    t = x.shape[0]
    if t == 0:
        return fn(x.new_zeros((tile, *x.shape[1:])))[:0]
    x = padded_rows(x, tile)  # one launch (a decode step pads its rows to one tile)
    if x.shape[0] == tile:
        return fn(x)[:t]
    return torch.cat([fn(chunk) for chunk in x.split(tile)])[:t]


def padded_rows(x: torch.Tensor, tile: int) -> torch.Tensor:
    """x [T, ...] (T > 0) with zero rows appended up to a whole number of tiles, as `tiled`
    pads it (one concatenation, the same memo)."""
    pad = (-x.shape[0]) % tile
    return _padded(x, pad, tile) if pad else x


_LAST_PAD: list = []  # [(source, key, padded)]: q, k and v pad one input once
# zero rows to pad with, [tile, ...] per (device, dtype, tile, row shape): written once, never
# freed nor replaced (a captured decode graph reads the one it was captured with)
_ZERO_ROWS: dict[tuple, torch.Tensor] = {}


def _padded(x: torch.Tensor, pad: int, tile: int) -> torch.Tensor:
    """x with `pad` (< tile) zero rows appended, in one launch (a concatenation with cached
    zero rows; `F.pad` fills the whole output, then copies x in). The last result is reused
    for the same bytes: the memo holds its source, so a match of (address, shape, strides,
    dtype, version) is the same storage, unmodified (the attention's q, k and v projections
    read one normed input)."""
    key = (x.data_ptr(), x.device, x.dtype, tuple(x.shape), x.stride(), x._version, pad)
    if _LAST_PAD and _LAST_PAD[0][1] == key:
        return _LAST_PAD[0][2]
    zkey = (x.device, x.dtype, tile, tuple(x.shape[1:]))
    zeros = _ZERO_ROWS.get(zkey)
    if zeros is None:
        zeros = _ZERO_ROWS[zkey] = x.new_zeros((tile, *x.shape[1:]))
    out = torch.cat([x, zeros[:pad]])
    _LAST_PAD[:] = [(x, key, out)]
    return out


def one_group_fits(x: torch.Tensor, w) -> bool:
    """bf16 weight and rows (T > 0), N and K in whole 16 bytes, sm90+: `_grouped_mm`'s terms."""
    if not (isinstance(w, torch.Tensor) and w.dtype is x.dtype is torch.bfloat16):
        return False
    aligned = w.shape[0] % 8 == 0 and w.shape[1] % 8 == 0
    return aligned and x.shape[0] > 0 and tensor_cores_available(x.device)  # cached per device


def one_group(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [N, K]^T in one launch whatever T (not a cuBLAS launch per tile): one group
    of `torch._grouped_mm`, the bf16 experts' kernel, batch-invariant (the GPU tier checks it);
    the tiles' bytes not by construction: the engine's `dense_gemm="grouped"` only."""
    offs = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
    return torch._grouped_mm(x, w.unsqueeze(0).transpose(-2, -1), offs=offs)
