"""NVFP4 `scale_mode="4over6"` (docs/formats.md, "NVFP4 4over6"): the reference against a NumPy
+ ml_dtypes transcription of the rule, the by-construction guarantee against the standard
block (never a higher error, in the rule's own error and in float64 on the dequantized values),
ties, zero / underflow / non-finite blocks, and what the option leaves alone (global scale,
layout, dequantize)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mxrl.formats import codecs, dequantize, quantize
from mxrl.formats import constants as C
from mxrl.formats.nvfp4 import SCALE_MODES
from tests import cases
from tests.formats.test_nvfp4 import SUITE
from tests.numerics import assert_bytes_equal, assert_qtensor_bytes_equal, sqnr_db

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

F32 = np.float32


def spec_4over6_numpy(x: torch.Tensor, per_token: bool):
    """docs/formats.md "NVFP4 4over6", step by step in NumPy float32 with ml_dtypes casts
    (independent of torch and of the reference's code). Returns (packed, scale bytes, S_enc)."""
    xf = x.to(torch.float32).numpy()
    lead, k = xf.shape[:-1], xf.shape[-1]
    blocks = xf.reshape(*lead, k // 16, 16)
    b_amax = np.abs(blocks).max(axis=-1)
    g = b_amax.max(axis=-1, keepdims=True) if per_token else b_amax.max()
    with np.errstate(divide="ignore"):
        s_enc = np.minimum(F32(2688.0) / F32(g), F32(C.FLT_MAX)).astype(F32)
    s_enc = np.where((g == 0) | (s_enc == 0), F32(1.0), s_enc).astype(F32)
    s_dec = (F32(1.0) / s_enc).astype(F32)
    s_enc_b = s_enc[..., None] if per_token else s_enc  # over (blocks, elements)
    u = (blocks * s_enc_b).astype(F32)

    def candidate(per_amax):
        t = (b_amax * (s_enc * per_amax).astype(F32)).astype(F32)
        s = np.clip(np.minimum(t, F32(C.FLT_MAX)), -448, 448).astype(ml_dtypes.float8_e4m3fn)
        with np.errstate(divide="ignore"):
            enc = (F32(1.0) / (s.astype(F32) * s_dec).astype(F32)).astype(F32)
        enc = np.minimum(enc, F32(C.FLT_MAX))
        with np.errstate(over="ignore"):
            scaled = (blocks * enc[..., None]).astype(F32)
        codes = np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn)
        d = ((codes.astype(F32) * s.astype(F32)[..., None]).astype(F32) - u).astype(F32)
        sq = (d * d).astype(F32)
        while sq.shape[-1] > 1:  # adjacent pairs, then pairs of pairs
            sq = (sq[..., 0::2] + sq[..., 1::2]).astype(F32)
        return s.view(np.uint8), codes.view(np.uint8), sq[..., 0]

    rcp6 = np.array([C.RCP_6_BITS], dtype=np.uint32).view(F32)[0]
    s6, c6, e6 = candidate(rcp6)
    s4, c4, e4 = candidate(F32(0.25))
    pick_4 = e4 < e6
    scale = np.where(pick_4, s4, s6)
    codes = np.where(pick_4[..., None], c4, c6).reshape(*lead, k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale, np.asarray(s_enc, dtype=F32)


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize(("label", "x"), SUITE, ids=[s[0] for s in SUITE])
def test_reference_matches_the_rule_transcribed(label, x, per_token):
    q = quantize(x, "nvfp4", per_token=per_token, scale_mode="4over6")
    packed, scale, s_enc = spec_4over6_numpy(x, per_token)
    assert_bytes_equal(q.qdata, torch.from_numpy(packed.copy()), f"{label} data")
    assert_bytes_equal(q.scale.view(torch.uint8), torch.from_numpy(scale.copy()), f"{label} scale")
    assert_bytes_equal(q.global_scale, torch.from_numpy(s_enc.copy()), f"{label} global scale")


def _block_errors(x: torch.Tensor, q) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rule's fp32 error per block, float64 squared error of the dequantized block)."""
    from mxrl.formats.nvfp4 import _block_sse

    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    codes = codecs.unpack_nibbles(q.qdata).reshape(blocks.shape)
    s_enc = q.global_scale
    u = blocks * (s_enc.unsqueeze(-1) if s_enc.dim() else s_enc)
    rule = _block_sse(codes, codecs.e4m3_decode(q.scale), u, torch.isfinite(blocks))
    deq = dequantize(q).double().reshape(blocks.shape)
    return rule, ((deq - blocks.double()) ** 2).sum(dim=-1)


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize("dist", ["normal", "student_t3"])
def test_never_worse_than_the_standard_block(dist, per_token):
    """By construction the map-to-6 candidate is the standard block, bytes and all, so every
    block's error is at most the standard's: exactly in the rule's error; on the dequantized
    values in float64 up to the rule's fp32 rounding (a relative 1e-5, near-ties only)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 1024, generator=g)
    if dist == "student_t3":
        x = torch.distributions.StudentT(3.0).sample((512, 1024))
    std = quantize(x, "nvfp4", per_token=per_token)
    ada = quantize(x, "nvfp4", per_token=per_token, scale_mode="4over6")
    assert_bytes_equal(ada.global_scale, std.global_scale, "global scale")
    rule_std, deq_std = _block_errors(x, std)
    rule_ada, deq_ada = _block_errors(x, ada)
    assert bool((rule_ada <= rule_std).all())
    assert bool((deq_ada <= deq_std * (1 + 1e-5)).all())
    # the blocks that kept 6 are the standard ones, byte for byte
    kept = ada.scale.view(torch.uint8) == std.scale.view(torch.uint8)
    codes_std = codecs.unpack_nibbles(std.qdata).reshape(*x.shape[:-1], -1, 16)
    codes_ada = codecs.unpack_nibbles(ada.qdata).reshape(codes_std.shape)
    assert_bytes_equal(codes_ada[kept], codes_std[kept], "codes of the map-to-6 blocks")
    moved = float((~kept).float().mean())
    assert 0.2 < moved < 0.6, moved  # ~45% (normal) and ~31% (t3) of the blocks pick 4
    gain = sqnr_db(x, dequantize(ada)) - sqnr_db(x, dequantize(std))
    assert gain > 0.3, gain  # measured 0.35-0.8 dB (docs/formats.md)


def test_ties_and_identical_candidates_keep_the_standard_block():
    """Zero blocks, underflow blocks (scale 0x00 in both candidates) and blocks at the tensor's
    amax, where the map-to-4 scale (672) saturates to 448, the map-to-6 one: the same block
    twice, so an equal error, and a tie keeps 6: the standard bytes."""
    for dtype in cases.DTYPES:
        for x in (cases.zeros((4, 64), dtype), cases.nvfp4_underflow(dtype)):
            assert_qtensor_bytes_equal(
                quantize(x, "nvfp4", scale_mode="4over6"), quantize(x, "nvfp4"), str(dtype)
            )
        x = torch.tensor([[1.0, -1.0, 0.5, 0.25] * 4] * 2, dtype=dtype)
        q = quantize(x, "nvfp4", scale_mode="4over6")
        assert_qtensor_bytes_equal(q, quantize(x, "nvfp4"), f"at the amax, {dtype}")
        assert q.scale.view(torch.uint8).tolist() == [[C.E4M3_MAX_CODE]] * 2


def test_a_block_in_the_dead_zone_picks_four():
    """A block of amax 1 in a tensor of amax 1.5 whose other elements are 5/6 of its amax:
    mapped to 6 they sit near 5, the widest gap of the grid, and round to 4; mapped to 4 they
    land near 10/3, nearer to 3. (The map-to-4 scale, 448 / 1.5 * 1.5, does not saturate.)"""
    row = torch.tensor([1.5] + [0.0] * 15 + [1.0] + [5 / 6] * 15)
    q = quantize(row[None], "nvfp4", scale_mode="4over6")
    std = quantize(row[None], "nvfp4")
    assert q.scale.view(torch.uint8)[0, 0] == std.scale.view(torch.uint8)[0, 0]  # 6 is exact
    assert q.scale.view(torch.uint8)[0, 1] != std.scale.view(torch.uint8)[0, 1]
    err = (dequantize(q) - row).abs()[0, 16:].max()
    err_std = (dequantize(std) - row).abs()[0, 16:].max()
    assert err < 0.7 * err_std, (err, err_std)  # 0.083 against 0.131


@pytest.mark.parametrize("exponent", [-60, -20, 20, 60])
def test_bytes_do_not_depend_on_a_power_of_two_scale_of_the_tensor(exponent):
    """x and x * 2^k give the same codes and block scales (S_enc moves by 2^-k, exactly): the
    rule's error is measured in the encoded domain, which neither overflows nor underflows."""
    x = cases.randn((64, 256), torch.float32, seed=4, scale=3.0)
    for per_token in (False, True):
        q = quantize(x, "nvfp4", per_token=per_token, scale_mode="4over6")
        qk = quantize(x * 2.0**exponent, "nvfp4", per_token=per_token, scale_mode="4over6")
        assert_bytes_equal(qk.qdata, q.qdata, "data")
        assert_bytes_equal(qk.scale, q.scale, "scale")


def test_caller_amax_per_expert_and_the_same_layout():
    """A caller's per-expert global amax (gate+up weights, [E, 1, 1]): the layout, dtypes and
    global scale of the standard quantizer; dequantize reads it unchanged."""
    x = cases.randn((3, 32, 128), torch.bfloat16, seed=2, scale=2.0)
    amax = x.float().abs().flatten(1).amax(dim=1).reshape(3, 1, 1)
    q = quantize(x, "nvfp4", global_amax=amax, scale_mode="4over6")
    std = quantize(x, "nvfp4", global_amax=amax)
    for field in ("qdata", "scale", "global_scale"):
        a, b = getattr(q, field), getattr(std, field)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), field
    assert_bytes_equal(q.global_scale, std.global_scale, "global scale")
    assert sqnr_db(x.float(), dequantize(q)) > sqnr_db(x.float(), dequantize(std))


def test_scale_mode_is_checked():
    assert "4over6" in SCALE_MODES
    with pytest.raises(ValueError, match="nvfp4 scale_mode must be one of"):
        quantize(torch.ones(2, 16), "nvfp4", scale_mode="4over7")
    with pytest.raises(ValueError, match="mxfp8 scale_mode must be one of"):
        quantize(torch.ones(2, 32), "mxfp8", scale_mode="4over6")
    with pytest.raises(ValueError, match="fp8_block scale_mode"):
        quantize(torch.ones(2, 128), "fp8_block", block=(1, 128), scale_mode="4over6")


def test_a_caller_amax_below_its_data_is_refused_as_for_the_standard():
    """The amax checks are the standard ones: the global scale is the same (2688 / amax)."""
    x = torch.ones(4, 64) * 2.0
    with pytest.raises(ValueError, match="below the amax of the data"):
        quantize(x, "nvfp4", global_amax=1.0, scale_mode="4over6")
    with pytest.raises(ValueError, match="finite and non-negative"):
        quantize(x, "nvfp4", global_amax=float("nan"), scale_mode="4over6")
    with pytest.raises(ValueError, match="non-finite"):
        bad = x.clone()
        bad[1, 3] = float("inf")
        quantize(bad, "nvfp4", scale_mode="4over6", check_finite=True)
