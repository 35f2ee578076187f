"""MXFP8 reference against torchao (RCEIL and FLOOR modes) on the spec §6.3 suite, bytes only."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxrl.formats import codecs, dequantize, quantize
from tests import cases
from tests.numerics import assert_bytes_equal, assert_e4m3_equal_but_top, sqnr_db

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
Mode = torchao_mx.ScaleCalculationMode


def torchao_mxfp8(x: torch.Tensor, mode) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale bytes, data bytes) from torchao's eager `to_mx`."""
    scale, data = torchao_mx.to_mx(x.contiguous(), torch.float8_e4m3fn, 32, mode)
    return scale.view(torch.uint8), data.view(torch.uint8)


SUITE = list(cases.suite(cases.SHAPES_MXFP8)) + [
    (f"boundary-{d}", cases.boundary_pairs((16, 128), d)) for d in cases.DTYPES
]


@pytest.mark.parametrize(("label", "x"), SUITE, ids=[s[0] for s in SUITE])
def test_rceil_matches_torchao_rceil(label, x):
    """Byte for byte, except where torchao's element times its scale 2^120 overflows to Inf
    (the all-max inputs): there mxrl stores 240, not 256 (tests/formats/test_finite_range.py)."""
    q = quantize(x, "mxfp8")
    scale, data = torchao_mxfp8(x, Mode.RCEIL)
    assert_bytes_equal(q.scale.view(torch.uint8), scale, f"{label} scale")
    top = (scale.reshape(*x.shape[:-1], -1) == 247).repeat_interleave(32, dim=-1)
    assert_e4m3_equal_but_top(q.qdata, data, top, f"{label} data")


EDGES = [(f"pow2-edges-{d}", cases.mxfp8_pow2_edges(d)) for d in cases.DTYPES]


@pytest.mark.parametrize(("label", "x"), SUITE + EDGES, ids=[s[0] for s in SUITE + EDGES])
def test_floor_mode_matches_torchao_default(label, x):
    q = quantize(x, "mxfp8", scale_mode="floor")
    scale, data = torchao_mxfp8(x, Mode.FLOOR)
    assert_bytes_equal(q.scale.view(torch.uint8), scale, f"{label} scale")
    assert_bytes_equal(q.qdata, data, f"{label} data")


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_rceil_vs_floor_differs_exactly_where_documented(dtype):
    """torchao's default (OCP FLOOR) and our RCEIL differ by design (spec §2.2): the code is one
    higher under RCEIL exactly when the block amax's significand exceeds 1.75 (amax > 448*2^k),
    and only then can FLOOR push elements past 448 into saturation."""
    x = torch.cat(
        [cases.randn((64, 256), dtype, seed=3), cases.mxfp8_pow2_edges(dtype).repeat(1, 8)]
    )
    rceil = quantize(x, "mxfp8").scale.view(torch.uint8).to(torch.int32)
    floor = quantize(x, "mxfp8", scale_mode="floor").scale.view(torch.uint8).to(torch.int32)
    amax = x.float().abs().reshape(x.shape[0], -1, 32).amax(-1)
    mantissa = amax.view(torch.int32) & 0x7FFFFF
    above_1_75 = (mantissa > 0x600000) & (amax > 0)
    assert ((rceil - floor) == above_1_75.to(torch.int32)).all()
    assert above_1_75.any() and (~above_1_75).any()  # both branches exercised


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_pow2_edges_against_torchao_and_exact_rule(dtype):
    """§6.3.2: blocks whose amax is 448*2^k and its two neighbours in `dtype`.

    The codes must be the smallest c with 2^(c-127) >= fl(amax/448) (exact oracle). torchao's
    eager RCEIL fallback takes ceil(log2(descale)) in float (spec §5.1's caveat), which misses
    the round-up when descale is within an ulp above 2^k: the only allowed difference is ours =
    torchao + 1 on such blocks (fp32 upper neighbours), and every other byte is equal."""
    x = cases.mxfp8_pow2_edges(dtype)
    q = quantize(x, "mxfp8")
    ours = q.scale.view(torch.uint8).reshape(-1).to(torch.int32)
    descale = x.float().abs().amax(-1) / 448.0
    exact = torch.tensor([_smallest_pow2_code(float(d)) for d in descale], dtype=torch.int32)
    assert (ours == exact).all()

    scale, data = torchao_mxfp8(x, Mode.RCEIL)
    theirs = scale.reshape(-1).to(torch.int32)
    differ = ours != theirs
    log2_rounds_down = torch.log2(descale) == torch.floor(torch.log2(descale))
    assert (
        differ == (log2_rounds_down & (descale > 2.0 ** torch.floor(torch.log2(descale))))
    ).all()
    assert (ours[differ] == theirs[differ] + 1).all()
    if dtype == torch.float32:
        assert differ.any()  # the fp32 upper neighbours do hit the log2 rounding
    same = ~differ
    assert_bytes_equal(q.qdata[same], data[same], "data of agreeing blocks")


def _smallest_pow2_code(descale: float) -> int:
    c = 0
    while c < 254 and 2.0 ** (c - 127) < descale:
        c += 1
    return c


def test_amax_exactly_448_times_pow2_and_neighbours():
    """A block whose amax is 448*2^k gets code 127+k (no round-up), its upper neighbour 128+k,
    its lower neighbour 127+k; the element at amax encodes as 448 (0x7E) exactly."""
    x = cases.mxfp8_pow2_edges(torch.float32, exponents=range(-8, 9, 4))
    q = quantize(x, "mxfp8")
    codes = q.scale.view(torch.uint8).reshape(-1, 3).to(torch.int32)
    ks = torch.arange(-8, 9, 4, dtype=torch.int32)
    assert (codes[:, 0] == 127 + ks).all()
    assert (codes[:, 1] == 127 + ks).all()
    assert (codes[:, 2] == 128 + ks).all()
    at_edge = q.qdata[1::3][x[1::3].abs() == x[1::3].abs().amax(-1, keepdim=True)]
    assert (at_edge & 0x7F == 0x7E).all()


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_columnwise_copy_matches_torchao_on_transpose(dtype):
    """axis=0: 32x1 blocks along dim 0, data kept in x's layout, scale [M/32, K] (TE, §2.1);
    quantized from the high-precision input, not from the row-wise copy."""
    x = cases.randn((96, 160), dtype, seed=5)
    q = quantize(x, "mxfp8", axis=0)
    assert q.qdata.shape == (96, 160) and q.scale.shape == (3, 160) and q.axis == 0
    scale_t, data_t = torchao_mxfp8(x.t().contiguous(), Mode.RCEIL)
    assert_bytes_equal(q.scale.view(torch.uint8), scale_t.t().contiguous(), "col scale")
    assert_bytes_equal(q.qdata, data_t.t().contiguous(), "col data")
    rowwise = quantize(x, "mxfp8")
    assert not torch.equal(rowwise.qdata, q.qdata)


def test_columnwise_on_3d_expert_weights():
    x = cases.randn((4, 64, 96), torch.bfloat16, seed=9)  # [E, N, K]; blocks along N
    q = quantize(x, "mxfp8", axis=1)
    assert q.scale.shape == (4, 2, 96)
    for e in range(4):
        ref = quantize(x[e], "mxfp8", axis=0)
        assert_bytes_equal(q.qdata[e], ref.qdata, f"expert {e} data")
        assert_bytes_equal(q.scale[e].contiguous(), ref.scale, f"expert {e} scale")


def test_dequantize_is_exact_product():
    x = cases.randn((8, 64), torch.float32, seed=1)
    q = quantize(x, "mxfp8")
    values = codecs.e4m3_decode(q.qdata).reshape(8, 2, 32)
    scales = codecs.e8m0_to_f32(q.scale).unsqueeze(-1)
    assert_bytes_equal(dequantize(q), (values * scales).reshape(8, 64), "dequant")


def test_non_finite_inputs_come_out_nan_and_leave_the_block_alone():
    """docs/formats.md, "Non-finite inputs": the amax ignores NaN and ±Inf, so the scale and the
    other 31 elements are those of the block with a 0 there; NaN and ±Inf encode 0x7F. (TE's
    kernels ignore NaN too, but an Inf amax gives code 254 there, zeroing the block, and the Inf
    element saturates to 448: spec §2.4.) tests/formats/test_non_finite.py has the full table."""
    x = torch.ones(3, 32)
    x[:, 5] = 2.0
    x[0, 3] = float("nan")
    x[1, 7] = float("inf")
    x[2, 9] = -float("inf")
    q = quantize(x, "mxfp8")
    clean = quantize(torch.where(torch.isfinite(x), x, 0.0), "mxfp8")
    assert_bytes_equal(q.scale.view(torch.uint8), clean.scale.view(torch.uint8), "scales")
    assert int(q.scale.view(torch.uint8)[1, 0]) == 120  # 2 * fl(1/448) -> 2^-7; TE: 254
    bad = ~torch.isfinite(x)
    assert (q.qdata[bad] == 0x7F).all()
    assert_bytes_equal(q.qdata[~bad], clean.qdata[~bad], "finite elements")
    deq = dequantize(q)
    assert torch.isnan(deq[bad]).all() and torch.equal(deq[~bad], x[~bad])


@settings()
@given(
    rows=st.integers(16, 64),
    blocks=st.integers(4, 16),
    seed=st.integers(0, 2**31 - 1),
    log_scale=st.floats(-30, 30),
)
def test_sqnr_on_randn_at_least_28_db(rows, blocks, seed, log_scale):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32 * blocks, generator=g) * 2.0**log_scale
    assert sqnr_db(x, dequantize(quantize(x, "mxfp8"))) >= 28.0
