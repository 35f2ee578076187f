"""The Triton kernels on the CPU, under Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py where there is no CUDA), byte for byte against the reference on the spec §6.3 suite.

Skipped where triton is not importable (CI) and where CUDA is present (the GPU tier runs the
compiled kernels). The interpreter runs the E4M3 encoder's exact integer path (its own fp8 cast
does not round to nearest even); the GPU tier checks the hardware cvt path.
"""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import codecs
from mxrl.formats import constants as C
from mxrl.formats.mxfp8 import block_amax
from mxrl.formats.nvfp4 import global_encode_scale
from tests import cases
from tests.formats import test_finite_range as FR
from tests.formats import test_non_finite as NF
from tests.kernels import conftest
from tests.kernels import variants as V
from tests.numerics import assert_bytes_equal, assert_qtensor_bytes_equal

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
tc = pytest.importorskip("mxrl.kernels.triton_codecs")
pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(
        not conftest.INTERPRETER_READY,
        reason="interpreter tests run without CUDA, with TRITON_INTERPRET=1 set before triton "
        "is imported (pytest tests/kernels, or TRITON_INTERPRET=1 pytest)",
    ),
    # NumPy's IEEE division by zero / overflow (1/0 -> inf is the reference's semantics too)
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.*"),
]


@pytest.mark.parametrize("variant", V.VARIANTS, ids=V.VARIANT_IDS)
def test_kernels_match_reference_on_suite(variant):
    checked = 0
    for label, x in V.inputs(variant):
        if not variant.accepts(x):
            continue
        V.assert_same_bytes(variant, V.run_kernel(variant, x), V.run_reference(variant, x), label)
        checked += 1
    assert checked >= 8, f"{variant.name}: only {checked} inputs checked"


@pytest.mark.parametrize("config", NF.CONFIGS, ids=NF.CONFIG_IDS)
def test_non_finite_table(config):
    """tests/formats/test_non_finite.py's policy checks on the kernels' output (one NaN, +Inf or
    -Inf), and the kernels' bytes equal the reference's."""
    from mxrl.formats import quantize as reference_quantize
    from mxrl.kernels import quantize

    def on_triton(x, fmt, **kwargs):
        return quantize(x, fmt, backend="triton", **kwargs)

    for label, value in NF.VALUES.items():
        for index in NF.INDICES:
            x = NF.make_input(torch.bfloat16, index, value)
            got = NF.check_policy(on_triton, config, x)
            want = reference_quantize(x, config[1], **NF.call_kwargs(config, x))
            assert_qtensor_bytes_equal(got, want, f"{config[0]} {label} at {index}")


@pytest.mark.parametrize("config", FR.POW2, ids=[c[0] for c in FR.POW2])
def test_top_of_the_range_table(config):
    """tests/formats/test_finite_range.py's table on the kernels: at the scale 2^120 elements
    saturate to 240, finite inputs dequantize to finite values, the reference's bytes."""
    from mxrl.formats import quantize as reference_quantize
    from mxrl.kernels import quantize

    def on_triton(x, fmt, **kwargs):
        return quantize(x, fmt, backend="triton", **kwargs)

    for edge in FR.EDGES:
        FR.check_table(on_triton, config, edge)
        x = FR.edge_input(edge[1], edge[2])
        x = x.t().contiguous() if config[2].get("axis") == 0 else x
        got, want = (
            on_triton(x, config[1], **config[2]),
            reference_quantize(x, config[1], **config[2]),
        )
        assert_qtensor_bytes_equal(got, want, f"{config[0]} {edge[0]}")


# --- element codecs, element-wise over many fp32 values ------------------------------------------


def _codec_inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int32)
    spread = torch.randn(1 << 18, generator=g) * torch.exp2(
        torch.randint(-14, 14, (1 << 18,), generator=g).float()
    )
    # every E4M3 / E2M1 value and rounding midpoint, and one fp32 ulp on each side
    grid = codecs.e4m3_decode(torch.arange(0, 0x7F, dtype=torch.uint8))
    mids = torch.cat([(grid[1:] + grid[:-1]) / 2, torch.tensor([464.0, 2.0**-10])])
    e2m1 = torch.tensor([t for t, _ in C.E2M1_RNE_THRESHOLDS] + [6.0, 0.5, 3.0])
    pts = torch.cat([grid, mids, e2m1])
    pts = torch.cat([pts, torch.nextafter(pts, pts + 1), torch.nextafter(pts, pts - 1)])
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan")])
    return torch.cat(
        [
            every_bf16.float(),
            random_bits.view(torch.float32),
            spread,
            pts,
            -pts,
            pts * 7.0,
            special,
        ]
    )


@triton.jit
def _abs_nan_to_zero(v):
    """|v| with NaN -> 0 and Inf kept: feeds ceil_e8m0 / nvfp4_encode_scale their +Inf rule."""
    return tl.where(v != v, 0.0, tl.abs(v))


@triton.jit
def _codec_kernel(x_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    if OP == 0:
        r = tc.e4m3_encode(v, False).to(tl.int32)
    elif OP == 1:
        r = tc.e2m1_encode(v)
    elif OP == 2:
        r = tc.ceil_e8m0(_abs_nan_to_zero(v))
    elif OP == 3:
        r = tc.nvfp4_encode_scale(_abs_nan_to_zero(v)).to(tl.int32, bitcast=True)
    elif OP == 4:
        code = tc.ceil_e8m0(_abs_nan_to_zero(v))
        r = tc.e8m0_reciprocal(code).to(tl.int32, bitcast=True)
    elif OP == 5:
        r = tc.finite_abs(v).to(tl.int32, bitcast=True)
    else:
        r = tc.e4m3_decode_nonneg(tl.abs(v).to(tl.int32) & 0x7F).to(tl.int32, bitcast=True)
    tl.store(out_ptr + offs, r, mask=offs < n)


@pytest.fixture(scope="module")
def codec_kernel():
    def run(x: torch.Tensor, op: int) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=torch.int32)
        block = 1 << 16
        _codec_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), OP=op, BLOCK=block)
        return out

    return run


def test_e4m3_exact_encoder(codec_kernel):
    x = _codec_inputs()
    assert_bytes_equal(codec_kernel(x, 0), codecs.e4m3_encode(x).to(torch.int32), "e4m3")


def test_e2m1_encoder(codec_kernel):
    x = torch.cat([_codec_inputs(), torch.linspace(-8.0, 8.0, 200_001)])
    assert_bytes_equal(codec_kernel(x, 1), codecs.e2m1_encode(x).to(torch.int32), "e2m1")


def test_e8m0_ceil_and_reciprocal(codec_kernel):
    x = _codec_inputs()
    a = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs())
    code = codecs.ceil_e8m0(a)
    assert_bytes_equal(codec_kernel(x, 2), code.to(torch.int32), "ceil_e8m0")
    assert_bytes_equal(codec_kernel(x, 4), codecs.e8m0_reciprocal(code).view(torch.int32), "rcp")


def test_nvfp4_encode_scale(codec_kernel):
    x = _codec_inputs()
    a = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs())
    assert_bytes_equal(codec_kernel(x, 3), global_encode_scale(a).view(torch.int32), "S_enc")


def test_e4m3_decode(codec_kernel):
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)
    want = codecs.e4m3_decode(codes).view(torch.int32)
    assert_bytes_equal(codec_kernel(codes.float(), 6), want, "e4m3 decode")


def test_finite_abs_is_the_reference_block_amax_input(codec_kernel):
    """What every amax is taken over: |x|, NaN and ±Inf -> 0 (`formats.mxfp8.block_amax`)."""
    x = _codec_inputs()
    want = block_amax(x.reshape(-1, 1)).view(torch.int32)
    assert_bytes_equal(codec_kernel(x, 5), want, "finite_abs")


# --- launcher paths the suite does not reach with default configs --------------------------------


@pytest.mark.parametrize("scale_mode", ["te", "4over6"])
@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_nvfp4_two_pass_rows(dtype, scale_mode):
    """K wider than one tile: the program reads its rows twice (amax, then quantize)."""
    from mxrl.kernels.triton_nvfp4 import launch_nvfp4

    x = cases.randn((6, 208), dtype, seed=3, scale=5.0)
    kwargs = {"per_token": True, "scale_mode": scale_mode}
    ref = V.run_reference(V.Variant("t", "nvfp4", kwargs), x)
    cfg = {"TILE_ELEMS": 32, "LOOP_BLOCK_K": 64}
    q, s, gs = launch_nvfp4(x, None, config=cfg, four_over_six=scale_mode == "4over6")
    assert_bytes_equal(q, ref.qdata, "qdata")
    assert_bytes_equal(s, ref.scale.view(torch.uint8), "scale")
    assert_bytes_equal(gs.view(6, 1), ref.global_scale, "global_scale")


def test_mxfp8_narrow_tiles():
    from mxrl.kernels.triton_mxfp8 import launch_mxfp8

    x = cases.randn((96, 320), torch.bfloat16, seed=4, scale=3.0)
    ref_row = V.run_reference(V.Variant("r", "mxfp8"), x)
    ref_col = V.run_reference(V.Variant("c", "mxfp8", {"axis": 0}), x)
    for cfg in ({"BLOCK_M": 64, "BLOCK_K": 64}, {"BLOCK_M": 32, "BLOCK_K": 512}):
        q_row, s_row, q_col, s_col = launch_mxfp8(x, True, True, config=cfg)
        assert_bytes_equal(q_row, ref_row.qdata, f"{cfg} row")
        assert_bytes_equal(s_row, ref_row.scale.view(torch.uint8), f"{cfg} row scale")
        assert_bytes_equal(q_col, ref_col.qdata, f"{cfg} col")
        assert_bytes_equal(s_col, ref_col.scale.view(torch.uint8), f"{cfg} col scale")


@pytest.mark.parametrize("block", [16, 32, 64])
def test_fp8_block_other_block_sizes(block):
    from mxrl.formats import quantize as reference_quantize
    from mxrl.kernels import quantize

    x = cases.randn((2, 70, 128), torch.float32, seed=6, scale=2.0)
    for shape in ((1, block), (block, block)):
        got = quantize(x, "fp8_block", block=shape, backend="triton")
        assert_qtensor_bytes_equal(got, reference_quantize(x, "fp8_block", block=shape), str(shape))


def test_empty_rows():
    """`quantize` refuses a zero-size tensor on both backends (test_backend.py); the torch ops,
    called directly, launch nothing and return empty outputs of the right shapes."""
    from mxrl.kernels import ops, quantize

    x = torch.zeros((0, 64), dtype=torch.bfloat16)
    for fmt, kw in (("mxfp8", {}), ("nvfp4", {}), ("nvfp4", {"per_token": True})):
        with pytest.raises(ValueError, match="nothing to quantize"):
            quantize(x, fmt, backend="triton", **kw)
    q_row, s_row, _, _ = ops.quantize_mxfp8(x, True, False)
    assert q_row.shape == (0, 64) and s_row.shape == (0, 2)
    q, s, gs = ops.quantize_nvfp4(x, None, True)
    assert q.shape == (0, 32) and s.shape == (0, 4) and gs.shape == (0, 1)
