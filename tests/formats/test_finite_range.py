"""Finite in, finite out (docs/formats.md, "The top of the fp32 range"): the edge-case table.

A finite input, however large (up to FLT_MAX = 3.4028e38, bf16's max 3.3895e38), dequantizes to
finite values in every format. MXFP8 RCEIL and block FP8 with ue8m0 scales give a block whose
amax exceeds 448 * 2^119 (~2.98e38) the scale 2^120; RNE would round an element >= 248 * 2^120
(~3.2967e38) to E4M3 256, and 256 * 2^120 = 2^128 is +Inf in fp32. mxrl stores 240 (0x77) there,
the largest E4M3 value whose product with 2^120 is finite. Every other byte is the plain rule's.

Expected bytes are written by hand (E4M3: 0x77 = 1.875 * 2^7 = 240, 0x76 = 224, 0x7E = 448,
0x6C = 96; E8M0: 2^k is code 127 + k) or computed with NumPy fp32 / ml_dtypes, never by the
quantizer. `check_table` takes the quantize function, so the Triton interpreter tests run the
same table on the kernels (tests/kernels/test_interpreter.py).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mxrl.formats import codecs, dequantize, quantize
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

FLT_MAX = float(np.finfo(np.float32).max)
P120 = 2.0**120
TOP = 248.0 * P120  # the smallest fp32 value whose E4M3 image at 2^120 rounds to 256
TOP_DOWN = float(np.nextafter(np.float32(TOP), np.float32(0)))
TOP_UP = float(np.nextafter(np.float32(TOP), np.float32(np.inf)))
SCALE_EDGE = 448.0 * 2.0**119  # amax above this gets 2^120 (code 247), at it 2^119 (246)
SCALE_EDGE_UP = float(np.nextafter(np.float32(SCALE_EDGE), np.float32(np.inf)))
BF16_MAX = float(torch.finfo(torch.bfloat16).max)  # 0x7F7F = 1.9921875 * 2^127
BF16_7F77 = float(torch.tensor(0x7F77, dtype=torch.int16).view(torch.bfloat16))  # below TOP

# The power-of-two-scale formats: (name, fmt, kwargs).
POW2 = [
    ("mxfp8-row", "mxfp8", {}),
    ("mxfp8-col", "mxfp8", {"axis": 0}),
    ("fp8-1x128-ue8m0", "fp8_block", {"block": (1, 128), "scale_mode": "ue8m0"}),
    ("fp8-128x128-ue8m0", "fp8_block", {"scale_mode": "ue8m0"}),
]
# (label, input dtype, value v, E4M3 byte of +v, E8M0 code of the block, old rule's byte).
# The block holds +v, -v, 100 * 2^120 and 1.0 elsewhere: -v's byte is +v's | 0x80, and
# 100 * 2^120 keeps its RNE byte 0x6C (96: 100 ties to the even mantissa) wherever the scale is
# 2^120. "old" is what TE / torchao / DeepGEMM store (and mxrl did): 0x78 dequantizes to Inf.
EDGES = [
    ("240*2^120", torch.float32, 240.0 * P120, 0x77, 247, 0x77),
    ("248*2^120 - ulp", torch.float32, TOP_DOWN, 0x77, 247, 0x77),
    ("248*2^120 (tie)", torch.float32, TOP, 0x77, 247, 0x78),
    ("248*2^120 + ulp", torch.float32, TOP_UP, 0x77, 247, 0x78),
    ("FLT_MAX", torch.float32, FLT_MAX, 0x77, 247, 0x78),
    ("bf16 0x7F77", torch.bfloat16, BF16_7F77, 0x77, 247, 0x77),
    ("bf16 0x7F78", torch.bfloat16, TOP, 0x77, 247, 0x78),
    ("bf16 max", torch.bfloat16, BF16_MAX, 0x77, 247, 0x78),
    ("448*2^119", torch.float32, SCALE_EDGE, 0x7E, 246, 0x7E),
    ("448*2^119 + ulp", torch.float32, SCALE_EDGE_UP, 0x76, 247, 0x76),
]
EDGE_IDS = [e[0] for e in EDGES]


def edge_input(dtype: torch.dtype, value: float) -> torch.Tensor:
    """[128, 128] of ones; row 3 (or column 3, for the column-wise copy) holds v, -v and
    100 * 2^120 in its first 32 elements."""
    x = torch.ones(128, 128, dtype=torch.float32)
    x[3, 0], x[3, 1], x[3, 2] = value, -value, 100.0 * P120
    return x.to(dtype)


def check_table(quantize_fn, config, edge) -> None:
    """One row of the table through quantize_fn: the element bytes, the block's scale, and
    finite dequantized values (+-240 * 2^120 for the saturated ones)."""
    name, fmt, kwargs = config
    label, dtype, value, byte, code, _ = edge
    x = edge_input(dtype, value)
    col = kwargs.get("axis") == 0
    if col:
        x = x.t().contiguous()
    q = quantize_fn(x, fmt, **kwargs)
    data = q.qdata.t() if col else q.qdata
    what = f"{name} {label}"
    want = torch.tensor([byte, byte | 0x80], dtype=torch.uint8)
    assert_bytes_equal(data[3, :2].contiguous(), want, f"{what} elements")
    if code == 247:
        assert int(data[3, 2]) == 0x6C, f"{what}: 100 * 2^120 keeps its RNE byte 0x6C"
    if fmt == "mxfp8":
        scale = q.scale.view(torch.uint8)
        got_code = int(scale[0, 3] if col else scale[3, 0])
    else:  # the fp32 decode scale 2^k of block FP8 has the E8M0 code k + 127
        sf = float(q.scale.reshape(-1, q.scale.shape[-1])[0 if q.block[0] > 1 else 3, 0])
        mantissa, exponent = math.frexp(sf)
        assert mantissa == 0.5, f"{what}: ue8m0 scale {sf} is not a power of two"
        got_code = exponent - 1 + 127
    assert got_code == code, f"{what}: scale code {got_code}, want {code}"
    deq = dequantize(q)
    assert torch.isfinite(deq).all(), f"{what}: a finite input dequantized to Inf"
    e4m3 = float(np.array(byte, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn))
    expected = e4m3 * 2.0 ** (code - 127)
    got = (deq.t() if col else deq)[3, :2].tolist()
    assert got == [expected, -expected], f"{what}: dequantized {got}, want +-{expected}"


@pytest.mark.parametrize("edge", EDGES, ids=EDGE_IDS)
@pytest.mark.parametrize("config", POW2, ids=[c[0] for c in POW2])
def test_top_of_the_range_table(config, edge):
    check_table(quantize, config, edge)


@pytest.mark.parametrize("edge", EDGES, ids=EDGE_IDS)
def test_the_old_rule_is_the_oracles_rule(edge):
    """The table's "old" column is plain RNE + satfinite at 2^-120, by ml_dtypes: the bytes TE,
    torchao and DeepGEMM write, and exactly where they overflow to Inf mxrl stores 0x77."""
    label, _dtype, value, byte, code, old = edge
    scaled = np.float32(value) * np.float32(2.0 ** (127 - code))
    rne = int(
        np.array(min(scaled, 448.0), np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    )
    assert rne == old, label
    overflows = float(np.array(old, np.uint8).view(ml_dtypes.float8_e4m3fn)) * 2.0 ** (code - 127)
    assert (overflows > FLT_MAX) == (old != byte), label


@pytest.mark.parametrize(
    ("name", "fmt", "kwargs"),
    [
        ("mxfp8-floor", "mxfp8", {"scale_mode": "floor"}),
        ("fp8-1x128-fp32", "fp8_block", {"block": (1, 128)}),
        ("fp8-128x128-fp32", "fp8_block", {}),
        ("nvfp4-tensor", "nvfp4", {}),
        ("nvfp4-token", "nvfp4", {"per_token": True}),
        ("nvfp4-amax", "nvfp4", {"global_amax": FLT_MAX}),
        ("nvfp4-torchao", "nvfp4", {"scale_mode": "torchao"}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_other_variants_were_finite_already(name, fmt, kwargs, dtype):
    """FLOOR MXFP8 (top code 246: 448 * 2^119 is finite), block FP8 with fp32 scales (448 * fl(
    amax / 448) stays finite), NVFP4 (2688 * S_dec stays finite): the largest value's element
    saturates to the format's max and its block scale is the format's max, as before."""
    big = torch.finfo(dtype).max
    x = edge_input(dtype, big)
    q = quantize(x, fmt, **kwargs)
    deq = dequantize(q)
    assert torch.isfinite(deq).all(), name
    if fmt == "nvfp4":
        codes = codecs.unpack_nibbles(q.qdata)[3, :2]
        assert codes.tolist() == [0x7, 0xF], name  # +-6
        assert int(q.scale.view(torch.uint8)[3, 0]) == 0x7E, name  # 448
    else:
        assert q.qdata[3, :2].tolist() == [0x7E, 0xFE], name  # +-448
    if fmt == "fp8_block":  # the scale is DeepGEMM's fl(amax / 448), by NumPy
        sf = float(np.float32(np.float32(big) / np.float32(448.0)))
        block_scale = q.scale.reshape(-1, q.scale.shape[-1])[0 if q.block[0] > 1 else 3, 0]
        assert float(block_scale) == sf, name


TOP_BINADE = [*POW2, ("nvfp4-token", "nvfp4", {"per_token": True})]


@pytest.mark.parametrize("config", TOP_BINADE, ids=[c[0] for c in TOP_BINADE])
def test_every_amax_of_the_top_binade_comes_out_finite(config):
    """Rows whose amax runs over the top fp32 binade [2^127, FLT_MAX] (random bit patterns and
    both ends), each row also holding values just under the amax: every value finite."""
    name, fmt, kwargs = config
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0x7F000000, 0x7F7FFFFF, (1022,), generator=g, dtype=torch.int64)
    bits = torch.cat([bits, torch.tensor([0x7F000000, 0x7F7FFFFF])]).to(torch.int32)
    amax = bits.view(torch.float32)
    x = torch.rand(1024, 128, generator=g) * amax[:, None]
    x[:, 0], x[:, 17], x[:, 40] = amax, -amax, amax * 0.97
    if kwargs.get("axis") == 0:
        x = x.t().contiguous()
    deq = dequantize(quantize(x, fmt, **kwargs))
    assert torch.isfinite(deq).all(), f"{name}: {int((~torch.isfinite(deq)).sum())} Inf"


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8_block"])
def test_check_finite_takes_huge_finite_values(fmt):
    """check_finite=True refuses NaN/Inf only: FLT_MAX is a value like any other."""
    x = edge_input(torch.float32, FLT_MAX)
    assert torch.isfinite(dequantize(quantize(x, fmt, check_finite=True))).all()
