"""NVFP4 reference: TE operation order (spec §3.2-§3.4) checked against a NumPy + ml_dtypes
transcription of the spec; torchao's documented variant checked against torchao itself."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxrl.formats import codecs, dequantize, quantize
from mxrl.formats.constants import FLT_MAX, RCP_6_BITS
from tests import cases
from tests.numerics import HostReads, assert_bytes_equal, assert_qtensor_bytes_equal, sqnr_db

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

F32 = np.float32


def spec_nvfp4_numpy(x: torch.Tensor, per_token: bool):
    """Spec §3.2-§3.4 step by step in NumPy float32 with ml_dtypes casts (independent of torch).
    Returns (packed bytes, scale bytes, S_enc) as NumPy arrays."""
    xf = x.to(torch.float32).numpy()
    lead, k = xf.shape[:-1], xf.shape[-1]
    blocks = xf.reshape(*lead, k // 16, 16)
    b_amax = np.abs(blocks).max(axis=-1)
    g = b_amax.max(axis=-1, keepdims=True) if per_token else b_amax.max()
    with np.errstate(divide="ignore"):
        s_enc = np.minimum(F32(2688.0) / F32(g), F32(FLT_MAX)).astype(F32)
    s_enc = np.where((g == 0) | (s_enc == 0), F32(1.0), s_enc).astype(F32)
    s_dec = (F32(1.0) / s_enc).astype(F32)
    rcp6 = np.array([RCP_6_BITS], dtype=np.uint32).view(F32)[0]
    t = (b_amax * (s_enc * rcp6).astype(F32)).astype(F32)
    t = np.minimum(t, F32(FLT_MAX))
    s_block = np.clip(t, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    with np.errstate(divide="ignore"):
        enc = (F32(1.0) / (s_block.astype(F32) * s_dec).astype(F32)).astype(F32)
    enc = np.minimum(enc, F32(FLT_MAX))
    with np.errstate(over="ignore"):
        scaled = (blocks * enc[..., None]).astype(F32)
    codes = np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    codes = codes.reshape(*lead, k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, s_block.view(np.uint8), np.asarray(s_enc, dtype=F32)


def _assert_matches_spec(x, per_token, label):
    q = quantize(x, "nvfp4", per_token=per_token)
    packed, scale, s_enc = spec_nvfp4_numpy(x, per_token)
    assert_bytes_equal(q.qdata, torch.from_numpy(packed.copy()), f"{label} data")
    assert_bytes_equal(q.scale.view(torch.uint8), torch.from_numpy(scale.copy()), f"{label} scale")
    assert_bytes_equal(q.global_scale, torch.from_numpy(s_enc.copy()), f"{label} global scale")


SUITE = (
    list(cases.suite(cases.SHAPES_NVFP4))
    + [(f"boundary-{d}", cases.boundary_pairs((32, 128), d)) for d in cases.DTYPES]
    + [(f"underflow-{d}", cases.nvfp4_underflow(d)) for d in cases.DTYPES]
)


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize(("label", "x"), SUITE, ids=[s[0] for s in SUITE])
def test_te_order_matches_spec_transcription(label, x, per_token):
    _assert_matches_spec(x, per_token, label)


def test_underflow_blocks_get_scale_zero_and_codes_six():
    """§3.4: block amax / global amax ~ 1e-6 or 1e-7 -> E4M3 scale 0x00, enc = FLT_MAX, so every
    nonzero element saturates to code ±6 (0x7 / 0xF) although it dequantizes to 0."""
    x = cases.nvfp4_underflow(torch.float32)
    q = quantize(x, "nvfp4")
    scale = q.scale.view(torch.uint8)
    assert scale[1:].tolist() == [[0, 0], [0, 0], [0, 0]]
    codes = codecs.unpack_nibbles(q.qdata)
    assert (codes[1, :16] == 0x7).all() and (codes[1, 16:] == 0x0).all()
    assert (codes[2, :16] == 0x0).all() and (codes[2, 16:] == 0xF).all()
    assert (codes[3, :16] == 0x7).all() and (codes[3, 16:] == 0xF).all()
    assert (dequantize(q)[1:] == 0).all()


@pytest.mark.parametrize("per_token", [False, True])
def test_zeros_give_zero_codes_and_unit_global_scale(per_token):
    x = torch.zeros(4, 32)
    x[0, 0] = -0.0
    q = quantize(x, "nvfp4", per_token=per_token)
    assert (q.scale.view(torch.uint8) == 0).all()
    assert (q.global_scale == 1.0).all()  # §3.2: amax 0 -> S_enc = 1
    assert int(q.qdata[0, 0]) == 0x08  # -0.0 keeps its sign in the low nibble
    assert (q.qdata.reshape(-1)[1:] == 0).all()


def test_per_token_zero_row_among_others():
    x = cases.randn((6, 64), torch.float32, seed=2)  # row 1 is all zero
    q = quantize(x, "nvfp4", per_token=True)
    assert q.global_scale.shape == (6, 1)
    assert float(q.global_scale[1, 0]) == 1.0
    assert (q.qdata[1] == 0).all() and (q.scale[1].view(torch.uint8) == 0).all()


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_all_max_saturates_consistently(dtype):
    x = cases.all_max((2, 32), dtype)
    q = quantize(x, "nvfp4")
    amax = torch.tensor(torch.finfo(dtype).max, dtype=torch.float32)
    assert_bytes_equal(q.global_scale, torch.div(torch.tensor(2688.0), amax), "S_enc")
    assert (q.scale.view(torch.uint8) == 0x7E).all()  # t ~ 448
    codes = codecs.unpack_nibbles(q.qdata)
    assert (codes[:, 0::2] == 0x7).all() and (codes[:, 1::2] == 0xF).all()


def test_shared_global_amax_fuses_gate_and_up():
    """gate and up quantized with one caller-supplied amax get one global scale, and the bytes
    equal quantizing the concatenated [gate; up] as one tensor (what a fused GEMM sees)."""
    gate = cases.randn((64, 128), torch.bfloat16, seed=11, zero_row=False)
    up = cases.randn((64, 128), torch.bfloat16, seed=12, zero_row=False, scale=3.0)
    amax = torch.maximum(gate.float().abs().amax(), up.float().abs().amax())
    qg = quantize(gate, "nvfp4", global_amax=amax)
    qu = quantize(up, "nvfp4", global_amax=amax)
    fused = quantize(torch.cat([gate, up]), "nvfp4")
    assert_bytes_equal(qg.global_scale, qu.global_scale, "shared S_enc")
    assert_bytes_equal(qg.global_scale, fused.global_scale, "S_enc vs fused")
    assert_bytes_equal(torch.cat([qg.qdata, qu.qdata]), fused.qdata, "data vs fused")
    assert_bytes_equal(torch.cat([qg.scale, qu.scale]), fused.scale, "scale vs fused")
    alone = quantize(gate, "nvfp4")
    assert not torch.equal(alone.global_scale, qg.global_scale)


def test_dequantize_applies_block_then_global_scale():
    x = cases.randn((4, 64), torch.float32, seed=4)
    q = quantize(x, "nvfp4", per_token=True)
    values = codecs.e2m1_decode(codecs.unpack_nibbles(q.qdata)).reshape(4, 4, 16)
    s_block = codecs.e4m3_decode(q.scale).unsqueeze(-1)
    s_dec = (1.0 / q.global_scale).unsqueeze(-1)
    assert_bytes_equal(dequantize(q), ((values * s_block) * s_dec).reshape(4, 64), "dequant")


def test_nan_and_inf_mark_their_block_through_its_scale():
    """docs/formats.md, "Non-finite inputs": the amaxes ignore NaN and ±Inf (S_enc and the
    other blocks are those of the tensor with 0 there); the block holding one gets scale byte
    0x7F (E4M3 NaN), so its 16 values dequantize to NaN; its element codes are the normal
    encoding (NaN and +Inf 0x7, -Inf 0xF). Before, an Inf made S_enc = 1 and saturated to a
    finite 2688. tests/formats/test_non_finite.py has the full table."""
    x = torch.linspace(-1, 1, 48).reshape(1, 48).repeat(3, 1)
    x[0, 3] = float("nan")
    x[1, 21] = float("inf")
    x[2, 40] = -float("inf")
    for kwargs in ({}, {"per_token": True}):
        q = quantize(x, "nvfp4", **kwargs)
        clean = quantize(torch.where(torch.isfinite(x), x, 0.0), "nvfp4", **kwargs)
        assert_bytes_equal(q.global_scale, clean.global_scale, "global scale: finite amax")
        scale, want = q.scale.view(torch.uint8), clean.scale.view(torch.uint8).clone()
        want[0, 0] = want[1, 1] = want[2, 2] = 0x7F
        assert_bytes_equal(scale, want, "the bad blocks' scales are 0x7F, only those")
        codes = codecs.unpack_nibbles(q.qdata)
        assert [int(codes[0, 3]), int(codes[1, 21]), int(codes[2, 40])] == [0x7, 0x7, 0xF]
        deq = dequantize(q)
        nan_blocks = torch.zeros(3, 48, dtype=torch.bool)
        nan_blocks[0, :16] = nan_blocks[1, 16:32] = nan_blocks[2, 32:] = True
        assert torch.isnan(deq[nan_blocks]).all()
        assert_bytes_equal(deq[~nan_blocks], dequantize(clean)[~nan_blocks], "other blocks")


# ----------------------------------------------------------------------------------------------
# torchao: a different operation order and a block-scale clamp at 2^-6, by design (§3.4-§3.5)
# ----------------------------------------------------------------------------------------------

AO_SUITE = (
    [s for s in cases.suite(cases.SHAPES_NVFP4) if not s[0].startswith("zeros")]
    + [(f"boundary-{d}", cases.boundary_pairs((32, 128), d)) for d in cases.DTYPES]
    + [(f"underflow-{d}", cases.nvfp4_underflow(d)) for d in cases.DTYPES]
)


def torchao_nvfp4(x: torch.Tensor):
    nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    amax = x.float().abs().amax()
    pts = nvfp4_tensor.per_tensor_amax_to_scale(amax)
    scale, packed = nvfp4_tensor.nvfp4_quantize(x.contiguous(), 16, pts)
    return scale.view(torch.uint8), packed.view(torch.uint8)


@pytest.mark.parametrize(("label", "x"), AO_SUITE, ids=[s[0] for s in AO_SUITE])
def test_torchao_variant_is_exactly_torchao(label, x):
    q = quantize(x, "nvfp4", scale_mode="torchao")
    scale, packed = torchao_nvfp4(x)
    assert_bytes_equal(q.scale.view(torch.uint8).reshape(scale.shape), scale, f"{label} scale")
    assert_bytes_equal(q.qdata.reshape(packed.shape), packed, f"{label} data")


def test_torchao_clamps_tiny_and_zero_block_scales_where_te_writes_zero():
    """The documented difference on scales: TE emits 0x00 for zero and underflow blocks, torchao
    clamps the block scale to finfo(e4m3).tiny = 2^-6 (code 0x08)."""
    x = cases.nvfp4_underflow(torch.float32)
    x[1, 16:] = 0.0  # a zero block next to underflow blocks
    te = quantize(x, "nvfp4").scale.view(torch.uint8)
    ao = torchao_nvfp4(x)[0].reshape(te.shape)
    zero_in_te = te == 0
    assert int(zero_in_te.sum()) == 7  # row 0's zero block, the zero block, 5 underflow blocks
    assert (ao[zero_in_te] == 0x08).all()
    assert_bytes_equal(te[~zero_in_te], ao[~zero_in_te], "normal blocks agree")


# ----------------------------------------------------------------------------------------------
# properties
# ----------------------------------------------------------------------------------------------


@settings()
@given(
    rows=st.integers(2, 9),
    blocks=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    row_scales=st.lists(st.floats(-20, 20), min_size=9, max_size=9),
    bf16=st.booleans(),
)
def test_per_token_row_does_not_depend_on_other_rows(rows, blocks, seed, row_scales, bf16):
    g = torch.Generator().manual_seed(seed)
    mags = torch.tensor([2.0**s for s in row_scales[:rows]]).unsqueeze(-1)
    x = torch.randn(rows, 16 * blocks, generator=g) * mags
    x = x.to(torch.bfloat16 if bf16 else torch.float32)
    q = quantize(x, "nvfp4", per_token=True)
    for i in range(rows):
        alone = quantize(x[i : i + 1], "nvfp4", per_token=True)
        assert_bytes_equal(q.qdata[i : i + 1], alone.qdata, f"row {i} data")
        assert_bytes_equal(q.scale[i : i + 1], alone.scale, f"row {i} scale")
        assert_bytes_equal(q.global_scale[i : i + 1], alone.global_scale, f"row {i} S_enc")


@settings()
@given(
    rows=st.integers(16, 64),
    blocks=st.integers(8, 32),
    seed=st.integers(0, 2**31 - 1),
    log_scale=st.floats(-30, 30),
    per_token=st.booleans(),
)
def test_sqnr_on_randn_at_least_18_db(rows, blocks, seed, log_scale, per_token):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16 * blocks, generator=g) * 2.0**log_scale
    assert sqnr_db(x, dequantize(quantize(x, "nvfp4", per_token=per_token))) >= 18.0


@pytest.mark.parametrize("amax_shape", [(), (64, 1)])
def test_check_amax_false_reads_nothing_back_and_keeps_the_bytes(amax_shape):
    """A caller's global amax is checked (NaN/Inf/negative refused) by a read back to the host,
    a sync on a GPU; check_amax=False (an amax the caller computed finite) skips only that."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    amax = x.abs().amax() if not amax_shape else x.abs().amax(dim=-1, keepdim=True)
    with HostReads() as checked:
        q = quantize(x, "nvfp4", global_amax=amax)
    with HostReads() as trusted:
        q_trusted = quantize(x, "nvfp4", global_amax=amax, check_amax=False)
    assert checked.ops and not trusted.ops, (checked.ops, trusted.ops)
    assert_qtensor_bytes_equal(q_trusted, q, "check_amax=False")
    with pytest.raises(ValueError, match="global_amax must be finite"):
        quantize(x, "nvfp4", global_amax=torch.tensor(float("nan")))


def test_a_caller_amax_below_the_data_is_refused_where_it_would_clip():
    """A global_amax g scales its blocks by S_enc = fl(2688 / g); a block's E4M3 scale is
    t = amax_b * fl(S_enc * fl(1/6)). For g = 1 that factor is exactly 448 (by hand: fl(1/6)
    = 0x3E2AAAAB, 2688 * it = 448.0000134, within half an ulp of 448), so t = 448 * amax_b.
    RNE keeps t <= 464 at 448 (the tie 464 goes to 448's even mantissa); above 464 only the
    saturation does, and the data is clipped: refused, naming global_amax and both values."""
    x = torch.zeros(2, 32)
    x[0, 5] = 1.035  # t = 463.68: rounds to 448 like any value, no saturation
    quantize(x, "nvfp4", global_amax=1.0)
    x[1, 20] = -1.037  # t = 464.58: saturated
    with pytest.raises(ValueError, match=r"global_amax 1 at index \(\) is below .* 1.037"):
        quantize(x, "nvfp4", global_amax=1.0)
    with pytest.raises(ValueError, match=r"global_amax 1 at index \(1, 0\) is below"):
        quantize(x, "nvfp4", global_amax=torch.tensor([[2.0], [1.0]]))
    quantize(x, "nvfp4", global_amax=torch.tensor([[1.0], [1.04]]))  # per row: each fits
    quantize(x, "nvfp4", global_amax=1.0, check_amax=False)  # the caller's word: not checked


def test_per_expert_amax_below_one_expert_names_it():
    w = torch.ones(3, 4, 32)
    w[1, 2, 7] = 8.0  # expert 1's amax
    amax = torch.tensor([1.0, 4.0, 1.0]).reshape(3, 1, 1)
    with pytest.raises(ValueError, match=r"global_amax 4 at index \(1, 0, 0\) .* scales, 8:"):
        quantize(w, "nvfp4", global_amax=amax)
    quantize(w, "nvfp4", global_amax=amax * 2)


def test_a_zero_caller_amax_is_refused_unless_its_data_is_all_zero():
    """0 is the amax of all-zero data (S_enc = 1, spec §3.2's rule): a padding row, an expert
    that got no update. For other data it is a missing amax: with S_enc = 1 a block of amax
    1e-3 would get the E4M3 scale 1e-3 / 6, below E4M3's smallest 2^-9, and become 0."""
    x = torch.zeros(3, 16)
    x[1, 4] = 1e-3
    amax = torch.tensor([[0.0], [0.0], [0.0]])
    with pytest.raises(ValueError, match=r"global_amax 0 at index \(1, 0\) is below .* 0.001: a 0"):
        quantize(x, "nvfp4", global_amax=amax)
    amax[1, 0] = 1e-3
    q = quantize(x, "nvfp4", global_amax=amax)  # rows 0 and 2 are all zero: their 0 is right
    assert q.global_scale.reshape(-1)[[0, 2]].tolist() == [1.0, 1.0]
    q = quantize(x, "nvfp4", global_amax=0.0, check_amax=False)  # the caller's word: taken
    assert q.scale.view(torch.uint8)[1, 0] == 0 and dequantize(q)[1, 4] == 0  # 1e-3 is lost
