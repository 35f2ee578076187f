"""Element and scale codecs against ml_dtypes (an oracle nobody here wrote), over every code
and every rounding tie, and the saturation policy of spec §1.5 (hardware-verified values)."""

from __future__ import annotations

import math
import struct

import ml_dtypes
import numpy as np
import pytest
import torch

from mxrl.formats import codecs
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)


def _f32(values) -> torch.Tensor:
    return torch.from_numpy(np.asarray(values, dtype=np.float32))


def _grid_with_ties(representable: np.ndarray) -> np.ndarray:
    """Every representable value, every midpoint (tie) between neighbours, each +-1 fp32 ulp."""
    pos = np.unique(np.abs(representable[np.isfinite(representable)]).astype(np.float32))
    mids = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)
    pts = np.concatenate([pos, mids])
    pts = np.concatenate(
        [pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))]
    )
    return np.concatenate([pts, -pts]).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# E4M3
# ----------------------------------------------------------------------------------------------


def test_e4m3_decode_every_code_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = codecs.e4m3_decode(torch.from_numpy(codes)).numpy()
    finite = ~np.isnan(want)
    assert np.isnan(got[~finite]).all()
    assert (got[finite].view(np.uint32) == want[finite].view(np.uint32)).all()


def test_e4m3_encode_every_code_and_tie_matches_ml_dtypes():
    table = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    x = _grid_with_ties(table)
    x = x[np.abs(x) <= 448]  # ml_dtypes is non-saturating; saturation is tested below
    want = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = codecs.e4m3_encode(_f32(x))
    assert_bytes_equal(got, torch.from_numpy(want.copy()), "e4m3 grid")
    assert x.size > 1500  # 253 values, 252 ties, +-1ulp, both signs


@pytest.mark.parametrize(
    ("value", "code"),
    [  # spec §1.5, read off `cvt.rn.satfinite.e4m3x2.f32` on an H200 ...
        (464.0, 0x7E),
        (465.0, 0x7E),
        (1e9, 0x7E),
        (-1e9, 0xFE),
        (math.nan, 0x7F),
        (-math.nan, 0x7F),
        (-0.0, 0x80),
        (2.0**-10, 0x00),
        # ... except ±Inf, which the hardware saturates to ±448 (0x7E / 0xFE): mxrl writes NaN
        # (docs/formats.md, "Non-finite inputs")
        (math.inf, 0x7F),
        (-math.inf, 0x7F),
    ],
)
def test_e4m3_saturation_policy(value, code):
    got = codecs.e4m3_encode(torch.tensor([value], dtype=torch.float32))
    assert int(got[0]) == code


def test_e4m3_negative_nan_bit_pattern_is_canonicalised():
    neg_nan = struct.unpack("<f", struct.pack("<I", 0xFFC00000))[0]
    got = codecs.e4m3_encode(torch.tensor([neg_nan], dtype=torch.float32))
    assert int(got[0]) == 0x7F


# ----------------------------------------------------------------------------------------------
# E2M1
# ----------------------------------------------------------------------------------------------


def test_e2m1_decode_every_code_matches_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = codecs.e2m1_decode(torch.from_numpy(codes)).numpy()
    assert (got.view(np.uint32) == want.view(np.uint32)).all()  # code 8 is -0.0


def test_e2m1_encode_every_code_and_tie_matches_ml_dtypes():
    table = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    x = _grid_with_ties(table)
    x = np.concatenate([x, np.float32([0.0, -0.0, 6.5, -7.0, 1e30, -1e30])])
    want = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    got = codecs.e2m1_encode(_f32(x))
    assert_bytes_equal(got, torch.from_numpy(want.copy()), "e2m1 grid")


def test_e2m1_policy_signed_zero_inf_nan():
    x = torch.tensor([-0.0, -0.1, math.inf, -math.inf, math.nan, -math.nan])
    # -0 and tiny negatives keep the sign (0x8), ±Inf saturate to ±6, NaN -> +6 (spec §1.5).
    assert codecs.e2m1_encode(x).tolist() == [0x8, 0x8, 0x7, 0xF, 0x7, 0x7]


def test_nibble_packing_even_element_low_nibble_matches_torchao():
    from torchao.prototype.mx_formats.kernels import pack_uint4

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (7, 64), generator=g, dtype=torch.uint8)
    packed = codecs.pack_nibbles(codes)
    assert_bytes_equal(packed, pack_uint4(codes), "pack vs torchao")
    assert int(codecs.pack_nibbles(torch.tensor([0x1, 0x2], dtype=torch.uint8))[0]) == 0x21
    assert_bytes_equal(codecs.unpack_nibbles(packed), codes, "unpack")


# ----------------------------------------------------------------------------------------------
# E8M0
# ----------------------------------------------------------------------------------------------


def test_e8m0_decode_every_code_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = codecs.e8m0_to_f32(torch.from_numpy(codes)).numpy()
    assert np.isnan(got[255]) and np.isnan(want[255])
    assert (got[:255].view(np.uint32) == want[:255].view(np.uint32)).all()


def test_e8m0_reciprocal_is_exact():
    codes = torch.arange(255, dtype=torch.uint8)
    rcp = codecs.e8m0_reciprocal(codes).to(torch.float64)
    val = codecs.e8m0_to_f32(codes).to(torch.float64)
    prod = (rcp * val)[1:254]
    assert (prod == 1.0).all()
    assert rcp[0] == 2.0**127 and rcp[254] == 2.0**-127
    assert torch.isnan(codecs.e8m0_reciprocal(torch.tensor([255], dtype=torch.uint8)))[0]


def _ceil_e8m0_oracle(a: float) -> int:
    """Smallest code c with 2^(c-127) >= a, by exact float64 arithmetic (frexp)."""
    if math.isnan(a):
        return 255
    if a == 0.0:
        return 0
    if math.isinf(a):
        return 254
    mant, exp = math.frexp(a)  # a = mant * 2^exp, mant in [0.5, 1)
    c = (exp - 1 if mant == 0.5 else exp) + 127
    return min(max(c, 0), 254)


def test_ceil_e8m0_matches_exact_oracle_on_random_bit_patterns_and_edges():
    g = np.random.default_rng(0)
    bits = g.integers(0, 0x7F800000, size=200_000, dtype=np.uint32)
    edges = [
        0x0,
        0x1,
        0x3FFFFF,
        0x400000,
        0x400001,
        0x7FFFFF,
        0x800000,
        0x800001,
        0x7F000000,
        0x7F000001,
        0x7F7FFFFF,
        0x7F800000,
        0x7FC00000,
        0x3F800000,
        0x3F800001,
        0x3F7FFFFF,
    ]
    bits = np.concatenate([bits, np.array(edges, dtype=np.uint32)])
    a = bits.view(np.float32)
    got = codecs.ceil_e8m0(torch.from_numpy(a.copy())).numpy()
    want = np.array([_ceil_e8m0_oracle(float(v)) for v in a], dtype=np.uint8)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, (
        f"{bad.size} mismatches, first a={a[bad[0]]!r} got {got[bad[0]]} want {want[bad[0]]}"
    )
