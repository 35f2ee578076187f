"""Scale-factor layouts for native block-scaled GEMMs (spec §4.1).

QTensors keep scales linear ([rows, K/block]). cuBLAS / cuDNN / tcgen05 want the "128x4" layout:
512-byte tiles of 128 rows x 4 K-blocks, tiles row-tile-major; inside a tile, row r sits at
(r % 32) * 16 + (r % 128 // 32) * 4. Padding bytes are zero.

For an MXFP8 column-wise scale ([M/32, K]) swizzle its transpose (K rows, M/32 columns), §4.1.
"""

from __future__ import annotations

import torch

from mxrl.formats.constants import SWIZZLE_COLS, SWIZZLE_ROWS


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """[R, C] (or [B, R, C]) one-byte scales -> flat R'*C' (or [B, R'*C']) bytes, 128x4 layout,
    R' = roundup(R, 128), C' = roundup(C, 4), padding zero. Same dtype as `scale`."""
    if scale.element_size() != 1:
        raise TypeError(f"swizzle_scales takes one-byte scales (E8M0/E4M3), got {scale.dtype}")
    if scale.dim() not in (2, 3):
        raise ValueError(
            f"swizzle_scales takes [R, C] or [B, R, C], got shape {tuple(scale.shape)}"
        )
    batched = scale.dim() == 3
    s = scale.view(torch.uint8)
    if not batched:
        s = s.unsqueeze(0)
    b, r, c = s.shape
    rp, cp = _ceil_to(r, SWIZZLE_ROWS), _ceil_to(c, SWIZZLE_COLS)
    padded = torch.zeros((b, rp, cp), dtype=torch.uint8, device=s.device)
    padded[:, :r, :c] = s
    # [b, row_tile, i (r%128//32), j (r%32), col_tile, c%4] -> [b, row_tile, col_tile, j, i, c%4]
    tiles = padded.view(b, rp // 128, 4, 32, cp // 4, 4).permute(0, 1, 4, 3, 2, 5)
    out = tiles.reshape(b, rp * cp).view(scale.dtype)
    return out if batched else out[0]


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_scales` for one [rows, cols] matrix (drops the padding)."""
    rp, cp = _ceil_to(rows, SWIZZLE_ROWS), _ceil_to(cols, SWIZZLE_COLS)
    if swizzled.numel() != rp * cp:
        raise ValueError(f"{swizzled.numel()} bytes cannot hold a swizzled {rows}x{cols} scale")
    t = swizzled.reshape(-1).view(torch.uint8).view(rp // 128, cp // 4, 32, 4, 4)
    full = t.permute(0, 3, 2, 1, 4).reshape(rp, cp)
    return full[:rows, :cols].contiguous().view(swizzled.dtype)
