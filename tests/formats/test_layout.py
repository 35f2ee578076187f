"""128x4 scale swizzle (spec §4.1) against torchao's `to_blocked` and the cuBLAS offset formula,
full padded buffers compared byte for byte (padding must be zero)."""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import quantize, swizzle_scales, unswizzle_scales
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

SHAPES = [(1, 1), (1, 4), (128, 4), (130, 5), (300, 17), (256, 64), (7, 130)]


def _random_scales(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 255, shape, generator=g, dtype=torch.uint8).view(dtype)


def _offset_formula(rows: int, cols: int) -> torch.Tensor:
    """Byte offset of every (r, c) per §4.1, written out with scalar arithmetic."""
    cp = -(-cols // 4) * 4
    off = torch.empty(rows, cols, dtype=torch.long)
    for r in range(rows):
        for c in range(cols):
            off[r, c] = (
                (r // 128) * (cp // 4) * 512
                + (c // 4) * 512
                + (r % 32) * 16
                + ((r % 128) // 32) * 4
                + (c % 4)
            )
    return off


@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_torchao_to_blocked(shape, dtype):
    to_blocked = pytest.importorskip("torchao.prototype.mx_formats.utils").to_blocked
    s = _random_scales(shape, dtype)
    ours = swizzle_scales(s)
    assert ours.dtype == dtype
    assert_bytes_equal(ours.view(torch.uint8), to_blocked(s.view(torch.uint8)), f"{shape}")


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_offset_formula_with_zero_padding(shape):
    rows, cols = shape
    s = _random_scales(shape, torch.uint8, seed=1)
    ours = swizzle_scales(s)
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert ours.numel() == rp * cp
    want = torch.zeros(rp * cp, dtype=torch.uint8)
    want[_offset_formula(rows, cols).reshape(-1)] = s.reshape(-1)
    assert_bytes_equal(ours, want, f"{shape}")  # every padding byte is 0


def test_batched_is_concatenation_and_unswizzle_inverts():
    s = _random_scales((3, 130, 5), torch.float8_e4m3fn, seed=2)
    batched = swizzle_scales(s)
    for b in range(3):
        assert_bytes_equal(batched[b], swizzle_scales(s[b]), f"batch {b}")
        assert_bytes_equal(unswizzle_scales(batched[b], 130, 5), s[b], f"inverse {b}")


def test_swizzle_real_quantized_scales():
    x = torch.randn(200, 320)
    q = quantize(x, "nvfp4")
    sw = swizzle_scales(q.scale)
    assert sw.numel() == 256 * 20
    assert_bytes_equal(unswizzle_scales(sw, 200, 20), q.scale, "round trip")


def test_rejects_fp32_scales_and_bad_rank():
    with pytest.raises(TypeError, match="one-byte"):
        swizzle_scales(torch.ones(4, 4))
    with pytest.raises(ValueError, match="shape"):
        swizzle_scales(torch.ones(4, dtype=torch.uint8))
