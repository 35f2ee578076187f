"""Edge cases of the MXFP8 reference quantizer found by mutation testing (docs/mutation/README.md):
each expectation is worked out by hand from docs/formats.md and the OCP MX rules (an E8M0 scale
2^(code-127) per 32 elements, E4M3 elements), never from the function under test."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mxrl.formats import QTensor, dequantize
from mxrl.formats.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)


def _row_block(head: float, rest: float) -> torch.Tensor:
    """One 32-element block: `head` first, `rest` in the other 31."""
    block = torch.full((32,), rest)
    block[0] = head
    return block


def test_the_defaults_are_the_last_dim_and_rceil():
    """quantize_mxfp8(x) without axis or scale_mode: 1x32 blocks along the last dim, RCEIL.
    Block 0 has amax 1.875: RCEIL's 1.875 * fl(1/448) = 0.00419 lies in (2^-8, 2^-7], code
    127 - 7 = 120, where OCP FLOOR would give floor(log2 1.875) - 8 + 127 = 119. Under 2^-7 the
    elements are 1.875 * 128 = 240 (E4M3 1.875 * 2^7: exponent field 14, mantissa 7, 0x77) and
    1.0 * 128 = 2^7 (0x70). Block 1 has amax 3: 3 * fl(1/448) = 0.0067 also in (2^-8, 2^-7],
    code 120; 3 * 128 = 384 = 1.5 * 2^8 (0x7C), -1.5 * 128 = -192 = -1.5 * 2^7 (0xF4)."""
    x = torch.stack([torch.cat([_row_block(1.875, 1.0), _row_block(-1.5, 3.0)])])
    q = quantize_mxfp8(x)
    assert q.axis == -1 and q.scale.shape == (1, 2)
    assert q.scale.view(torch.uint8).tolist() == [[120, 120]]
    want = torch.tensor([0x77] + [0x70] * 31 + [0xF4] + [0x7C] * 31, dtype=torch.uint8)
    assert_bytes_equal(q.qdata, want.reshape(1, 64), "data")
    floor = quantize_mxfp8(x, scale_mode="floor")  # the other mode, for contrast: 119, 120
    assert floor.scale.view(torch.uint8).tolist() == [[119, 120]]
    assert int(floor.qdata[0, 0]) == 0x7E  # 1.875 * 256 = 480 saturates to 448


@pytest.mark.parametrize("axis", [0, -2])
def test_a_column_wise_copy_by_hand(axis):
    """x [64, 2] blocked along dim 0 (axis 0, or the same dim as -2 passed straight to
    quantize_mxfp8): scale [2, 2], one code per 32 rows of a column, qdata in x's layout.
    Column 0: rows 0-31 are 0.5 but row 5 = 1.0 (amax 1: code 119, scale 2^-8, so 0.5 -> 128 =
    0x70 and 1.0 -> 256 = 0x78); rows 32-63 are 2^-20 (code 99, each 256 = 0x78). Column 1:
    rows 0-31 are 3.0 but row 0 = -1.5 (amax 3: code 120; 384 = 0x7C, -192 = 0xF4); rows 32-63
    are 0 but row 40 = 448 (448 * fl(1/448) rounds to exactly 1: code 127; 448 = 0x7E). Every
    value is representable, so dequantize gives x back exactly."""
    x = torch.zeros(64, 2)
    x[:32, 0], x[5, 0], x[32:, 0] = 0.5, 1.0, 2.0**-20
    x[:32, 1], x[0, 1], x[40, 1] = 3.0, -1.5, 448.0
    q = quantize_mxfp8(x, axis=axis)
    assert q.axis == axis and q.block == (32, 1) and q.shape == (64, 2)
    assert q.scale.view(torch.uint8).tolist() == [[119, 120], [99, 127]]
    want = torch.zeros(64, 2, dtype=torch.uint8)
    want[:32, 0], want[5, 0], want[32:, 0] = 0x70, 0x78, 0x78
    want[:32, 1], want[0, 1], want[40, 1] = 0x7C, 0xF4, 0x7E
    assert_bytes_equal(q.qdata, want, "data")
    assert_bytes_equal(dequantize_mxfp8(q), x, "dequantized")


def _representable(shape, seed: int) -> torch.Tensor:
    """Random finite E4M3 values (|v| <= 448, subnormals and zeros included). A block of them has
    amax m <= 448, so RCEIL gives a scale 2^-j <= 1 with m * 2^j <= 448 and every v * 2^j is an
    E4M3 value again (an E4M3 value times a power of two, not above 448, has at most 3 mantissa
    bits): such a tensor comes back from quantize and dequantize bit for bit."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # the NaN bytes -> 448
    return torch.from_numpy(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))


@pytest.mark.parametrize("axis", [-1, 0, 1, -2, -3])
def test_every_axis_of_a_3d_tensor_round_trips_representable_values(axis):
    """[32, 64, 96] blocked along each dim (-2 and -3 are dims 1 and 0, passed as negative
    indices): dequantize puts each element back where it came from, in x's layout, along every
    axis; a block taken across the wrong dim, or a value moved back to the wrong dim, changes
    values (they are random) or the shape."""
    x = _representable((32, 64, 96), seed=abs(axis))
    q = quantize_mxfp8(x, axis=axis)
    assert q.qdata.shape == x.shape
    assert_bytes_equal(dequantize_mxfp8(q), x, f"axis {axis}")


def test_dequantize_takes_the_scale_of_each_block_of_a_3d_tensor():
    """Hand bytes for a [2, 2, 64] row-wise tensor: every element code 0x38 (E4M3 1.0: exponent
    field 7, mantissa 0) and the eight blocks' codes give 2^(code - 127): 127 -> 1, 128 -> 2,
    120 -> 2^-7, 0 -> 2^-127 (code 0 is 2^-127, not 0: spec §1.3), 126 -> 1/2, 254 -> 2^127,
    1 -> 2^-126, 200 -> 2^73. A QTensor built from these bytes dequantizes to those powers,
    each over its own 32 elements."""
    codes = torch.tensor([[[127, 128], [120, 0]], [[126, 254], [1, 200]]], dtype=torch.uint8)
    q = QTensor(
        qdata=torch.full((2, 2, 64), 0x38, dtype=torch.uint8),
        scale=codes.view(torch.float8_e8m0fnu),
        fmt="mxfp8",
        shape=(2, 2, 64),
    )
    powers = [[[0, 1], [-7, -127]], [[-1, 127], [-126, 73]]]
    want = torch.tensor(powers, dtype=torch.float64).exp2().float().repeat_interleave(32, dim=-1)
    assert_bytes_equal(dequantize(q), want, "dequantized")
