"""Edge cases of the element and scale codecs found by mutation testing (docs/mutation/README.md):
each expectation is worked out by hand from the bit layouts of spec §1 (E4M3: 1-4-3, bias 7;
E8M0: 2^(code-127), 255 NaN) and docs/formats.md, or taken from NumPy's IEEE fp32 division,
never from the function under test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mxrl.formats import codecs
from mxrl.formats.constants import FLT_MAX
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

# fp32 divisors, normal, tiny and huge; for some of them 2688 * fl(1 / a) != fl(2688 / a)
_A = np.float32([3.0, 7.0, 0.1, 448.0, 1e-30, 6.0e4, 2.5e38, 1.2345678e-34])


def _ieee(n, d) -> torch.Tensor:
    """One IEEE fp32 division by NumPy (an oracle nobody here wrote)."""
    return torch.from_numpy(np.asarray(np.float32(n) / np.float32(d), dtype=np.float32))


def test_fdiv_is_one_ieee_division_whichever_operand_is_the_python_number():
    """fdiv(number, tensor), fdiv(tensor, number) and fdiv(tensor, tensor) are NumPy's fp32
    division bit for bit, fp32, of the tensor's shape (docs/formats.md: every a / b is one
    IEEE fp32 division)."""
    a = torch.from_numpy(_A.copy())
    for got, want in (
        (codecs.fdiv(2688.0, a), _ieee(2688.0, _A)),
        (codecs.fdiv(a, 448.0), _ieee(_A, 448.0)),
        (codecs.fdiv(a, a.flip(0)), _ieee(_A, _A[::-1])),
        (codecs.fdiv(1.0, a), _ieee(1.0, _A)),
    ):
        assert_bytes_equal(got, want)
    # the case the docstring names: torch's 2688 / a (reciprocal, then multiply) rounds twice
    twice = (a.reciprocal() * 2688.0).view(torch.int32)
    assert (twice != _ieee(2688.0, _A).view(torch.int32)).any()


def test_fdiv_takes_every_operand_to_fp32_first():
    """A float64 or bfloat16 operand is converted to fp32 before the one division: the result is
    fp32 and equals the fp32 division of the converted values (1/3 in fp64 -> fl32(1/3) first)."""
    third = torch.tensor([1.0 / 3.0], dtype=torch.float64)
    got = codecs.fdiv(third, 7.0)
    assert got.dtype == torch.float32
    assert_bytes_equal(got, _ieee(np.float32(1.0 / 3.0), 7.0).reshape(1))
    b = torch.tensor([3.0, 0.1], dtype=torch.bfloat16)  # 0.1 is 0.10009765625 in bf16
    got = codecs.fdiv(7.0, b)
    assert got.dtype == torch.float32
    assert_bytes_equal(got, _ieee(7.0, np.float32([3.0, 0.10009765625])))
    got = codecs.fdiv(torch.tensor(5.0, dtype=torch.float64), torch.tensor([2.0]))
    assert got.dtype == torch.float32 and got.tolist() == [2.5]


def test_e4m3_encode_under_a_limit_saturates_both_signs_there():
    """With `limit` (240 where the E8M0 scale is 2^120, docs/formats.md "The top of the fp32
    range") finite values saturate to +-limit, not +-448; non-finite ones stay 0x7F, and values
    below the limit round as always. By hand: 300 and 248 (RNE would give 288 = 0x79 and
    256 = 0x78) -> 240 = 1.875 * 2^7 (exponent field 14, mantissa 7: 0x77), -300 -> 0xF7;
    239 -> 240 (0x77, its nearest E4M3); 100, the tie of 96 and 104, -> 96 (even mantissa:
    1.5 * 2^6, 0x6C). The limit broadcasts per element: under 448, 300 -> 288 (0x79)."""
    x = torch.tensor([300.0, -300.0, 248.0, -248.0, 239.0, 100.0, math.nan, math.inf, -math.inf])
    got = codecs.e4m3_encode(x, torch.tensor(240.0))
    assert got.tolist() == [0x77, 0xF7, 0x77, 0xF7, 0x77, 0x6C, 0x7F, 0x7F, 0x7F]
    per_element = torch.tensor([240.0, 448.0, 240.0, 448.0])
    got = codecs.e4m3_encode(torch.tensor([300.0, 300.0, -500.0, -500.0]), per_element)
    assert got.tolist() == [0x77, 0x79, 0xF7, 0xFE]


def test_e4m3_limit_is_240_from_code_247_up():
    """448 x 2^(c-127) overflows fp32 from c = 247 (2^120: 448 * 2^120 > FLT_MAX = 3.4e38), where
    the cap is 240 (240 * 2^120 = 3.19e38); 448 below it. fp32, the codes' shape."""
    codes = torch.tensor([[0, 127, 246, 247], [248, 253, 254, 255]], dtype=torch.uint8)
    got = codecs.e4m3_limit(codes)
    assert got.dtype == torch.float32 and got.shape == (2, 4)
    assert got.tolist() == [[448.0, 448.0, 448.0, 240.0], [240.0, 240.0, 240.0, 240.0]]


def test_e4m3_decode_takes_float8_bytes_as_they_are():
    """A float8_e4m3fn tensor decodes to its own values: 0x38 = 1.0, 0x7E = 448, 0xF4 = -1.5 *
    2^7 = -192, 0x01 = 2^-9 (the smallest subnormal: 1/8 * 2^-6)."""
    codes = torch.tensor([0x38, 0x7E, 0xF4, 0x01], dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = codecs.e4m3_decode(codes)
    assert got.dtype == torch.float32 and got.tolist() == [1.0, 448.0, -192.0, 2.0**-9]


def test_pack_nibbles_refuses_an_odd_count():
    """Two codes per byte: an odd last dim cannot be packed (spec §1.2)."""
    with pytest.raises(AssertionError):
        codecs.pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(AssertionError):
        codecs.pack_nibbles(torch.zeros(1, dtype=torch.uint8))


def test_unpack_nibbles_of_a_3d_tensor_keeps_rows_apart():
    """Byte 0x21 holds element 2i = 1 (low nibble) and 2i + 1 = 2 (high): per row of a
    [1, 2, 3] tensor of bytes, in order, into [1, 2, 6] (its last dim, not a middle one,
    doubled)."""
    packed = torch.tensor([[[0x21, 0x43, 0x65], [0x87, 0xA9, 0xCB]]], dtype=torch.uint8)
    got = codecs.unpack_nibbles(packed)
    assert got.tolist() == [[[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]]


@pytest.mark.parametrize(
    ("a", "emax", "code"),
    [  # code = floor(log2 a) - emax + 127, the unbiased part clamped to [-127, 128]
        (1.0, 8, 119),
        (0.75, 8, 118),  # floor(log2 0.75) = -1
        (448.0, 8, 127),  # 1.75 * 2^8
        (480.0, 8, 127),  # 1.875 * 2^8: FLOOR keeps 2^0 (its elements saturate)
        (FLT_MAX, 8, 246),  # 2^127 * (2 - 2^-23)
        (6.0, 2, 127),  # the E2M1 emax
        (2.0**-118, 8, 1),  # -118 - 8 = -126
        (2.0**-119, 8, 0),  # -127
        (2.0**-120, 8, 0),  # -128, clamped to -127
        (0.0, 8, 0),  # exponent field 0: -135, clamped
        (2.0**-149, 8, 0),  # the smallest subnormal, exponent field 0
        (FLT_MAX, 0, 254),  # 127
        (FLT_MAX, -1, 255),  # 128, the top of the clamp (the NaN code)
        (FLT_MAX, -2, 255),  # 129, clamped to 128
        (math.nan, 8, 255),
    ],
)
def test_floor_e8m0_by_hand(a, emax, code):
    """The OCP FLOOR rule (spec §2.2) on values whose exponent is read off by hand."""
    got = codecs.floor_e8m0(torch.tensor([a], dtype=torch.float32), emax)
    assert got.dtype == torch.uint8 and got.tolist() == [code]


_CODES = [0, 1, 126, 127, 128, 254, 255]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e8m0fnu])
def test_e8m0_value_and_reciprocal_by_hand(dtype):
    """2^(c-127) and 2^(127-c) from uint8 codes and from float8_e8m0fnu bytes alike; code 0 is
    2^-127 (an fp32 subnormal), 254 is 2^127, 255 is NaN (spec §1.3)."""
    codes = torch.tensor(_CODES, dtype=torch.uint8).view(dtype)
    value = codecs.e8m0_to_f32(codes).tolist()
    rcp = codecs.e8m0_reciprocal(codes).tolist()
    assert value[:-1] == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert rcp[:-1] == [2.0**127, 2.0**126, 2.0, 1.0, 0.5, 2.0**-127]
    assert math.isnan(value[-1]) and math.isnan(rcp[-1])


def test_ceil_e8m0_of_inf_and_nan_and_the_top():
    """+Inf saturates to 254 (2^127) and NaN is 255 (spec §2.2); FLT_MAX would round up past
    2^127 and is capped at 254 too. 2^127 is exactly 254, 1.5 * 2^126 rounds up to it, and
    2^126 is exactly 253."""
    a = torch.tensor([math.inf, math.nan, FLT_MAX, 2.0**127, 2.0**126 * 1.5, 2.0**126])
    got = codecs.ceil_e8m0(a)
    assert got.dtype == torch.uint8 and got.tolist() == [254, 255, 254, 254, 254, 253]


def test_the_e2m1_table_is_built_once_per_device():
    """e2m1_decode looks its 16 values up in a table kept per device: built once, not per call
    (on a GPU each build is a host-to-device copy). The table is spec §1.2's: 0, 0.5, 1, 1.5, 2,
    3, 4, 6 and their negatives, code 8 being -0.0."""
    cpu = torch.device("cpu")
    table = codecs._e2m1_table(cpu)
    assert codecs._e2m1_table(cpu) is table
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert table.dtype == torch.float32 and table.tolist() == want + [-v for v in want]
    assert math.copysign(1.0, table[8].item()) == -1.0


@pytest.mark.gpu
def test_fdiv_on_the_gpu_is_numpys_ieee_division_for_every_operand_on_any_device():
    """CUDA evaluates `tensor / host_scalar` as `tensor * (1 / scalar)`, two roundings
    (docs/formats.md: 55% of `a / 448.0` differed on the H200). fdiv fills a Python number, and
    moves a tensor operand, onto the numerator tensor's device as fp32 first: a Python 448, a
    host 0-d 448 or a host vector of divisors beside CUDA numerators all give NumPy's fp32
    division, on the GPU; a host vector numerator takes a CUDA denominator to the host."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(10_000) * 10.0 ** rng.integers(-20, 20, 10_000)).astype(np.float32)
    d = (rng.random(10_000) * 1000 + 1).astype(np.float32)
    cuda, host = torch.from_numpy(a).cuda(), torch.from_numpy(d)
    for got, want in (
        (codecs.fdiv(cuda, 448.0), _ieee(a, 448.0)),
        (codecs.fdiv(cuda, torch.tensor(448.0)), _ieee(a, 448.0)),
        (codecs.fdiv(cuda, host), _ieee(a, d)),
        (codecs.fdiv(2688.0, cuda), _ieee(2688.0, a)),
    ):
        assert got.device.type == "cuda"
        assert_bytes_equal(got.cpu(), want)
    back = codecs.fdiv(host, cuda)
    assert back.device.type == "cpu"
    assert_bytes_equal(back, _ieee(d, a))
