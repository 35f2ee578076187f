"""The engine's batch-invariant tiles (mxrl/nn/paths/tiles.py): `tiled` hands its function
slices of exactly `tile` rows, the last one padded with zero rows, and gives back the rows it was
given; `_padded` pads in one concatenation with zero rows written once per (device, dtype, tile,
row shape), and reuses its last result only for the same unmodified input."""

from __future__ import annotations

import pytest
import torch

from mxrl.nn.paths import tiles
from mxrl.nn.paths.tiles import tiled


def _recording():
    seen = []

    def fn(x):
        seen.append(x.clone())
        return x * 2 + 1  # row-wise: each output row from its own input row

    return fn, seen


@pytest.mark.parametrize("cols", [3, 4])  # 4: as many columns as the tile has rows
@pytest.mark.parametrize(
    ("rows", "tile", "calls"), [(6, 4, 2), (8, 4, 2), (3, 4, 1), (4, 4, 1), (1, 4, 1)]
)
def test_tiled_hands_its_function_whole_tiles_and_returns_the_rows_given(rows, tile, calls, cols):
    fn, seen = _recording()
    x = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 1
    y = tiled(fn, x, tile)
    assert y.shape == (rows, cols)
    torch.testing.assert_close(y, x * 2 + 1, rtol=0, atol=0)
    assert len(seen) == calls and all(s.shape == (tile, cols) for s in seen)
    fed = torch.cat(seen)
    torch.testing.assert_close(fed[:rows], x, rtol=0, atol=0)
    assert not fed[rows:].any(), "the padding rows are zeros"


def test_tiled_with_tile_zero_runs_all_rows_at_once():
    fn, seen = _recording()
    x = torch.randn(7, 5)
    y = tiled(fn, x, 0)
    assert len(seen) == 1 and seen[0].shape == (7, 5)
    torch.testing.assert_close(y, x * 2 + 1, rtol=0, atol=0)


def test_tiled_on_no_rows_runs_one_zero_tile_and_returns_none():
    """No rows still runs the function once on a zero tile (a fixed shape), and returns its
    output's columns with no rows."""
    fn, seen = _recording()
    y = tiled(lambda t: fn(t)[:, :2], torch.empty(0, 5), 4)
    assert y.shape == (0, 2)
    assert len(seen) == 1 and seen[0].shape == (4, 5) and not seen[0].any()


def test_padding_reuses_its_last_result_only_for_the_same_unmodified_input():
    a, b = torch.randn(3, 8), torch.randn(3, 8)
    pa = tiles._padded(a, 1, 4)
    assert tiles._padded(a, 1, 4) is pa  # q, k and v pad one normed input once
    pb = tiles._padded(b, 1, 4)
    torch.testing.assert_close(pb[:3], b, rtol=0, atol=0)
    a.add_(1.0)  # the same storage, modified: a new padding of the new values
    pa2 = tiles._padded(a, 1, 4)
    assert pa2 is not pa
    torch.testing.assert_close(pa2[:3], a, rtol=0, atol=0)
    assert tiles._padded(a, 2, 4).shape == (5, 8)  # another pad of the same input


def test_zero_rows_are_written_once_per_row_shape_and_never_replaced():
    """A captured decode graph reads the zero rows it was captured with: they stay the same
    tensor for every later padding of that (device, dtype, tile, row shape)."""
    x = torch.randn(2, 8)
    out = tiles._padded(x, 2, 4)
    assert out.shape == (4, 8) and not out[2:].any()
    zeros = tiles._ZERO_ROWS[(x.device, x.dtype, 4, (8,))]
    for other in (torch.randn(3, 8), torch.randn(1, 8)):
        tiles._padded(other, 4 - other.shape[0], 4)
        assert tiles._ZERO_ROWS[(x.device, x.dtype, 4, (8,))] is zeros
    # other row shapes and dtypes get their own zero rows
    wide = tiles._padded(torch.randn(1, 16), 3, 4)
    half = tiles._padded(torch.randn(1, 8, dtype=torch.bfloat16), 3, 4)
    assert wide.shape == (4, 16) and half.dtype == torch.bfloat16 and half.shape == (4, 8)
    assert not wide[1:].any() and not half[1:].any()
