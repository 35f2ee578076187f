"""DeepSeek-style block FP8 against a NumPy + ml_dtypes transcription of DeepGEMM's
`per_block_cast_to_fp8` / `per_token_cast_to_fp8` (spec §5.2)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mxrl.formats import dequantize, quantize
from mxrl.formats.fp8_block import transpose_square_blocks
from tests import cases
from tests.numerics import assert_bytes_equal, assert_e4m3_equal_but_top, sqnr_db

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

F32 = np.float32


def deepgemm_numpy(x: torch.Tensor, block: tuple[int, int], ue8m0: bool = False):
    """(data bytes, fp32 scales) per spec §5.2, over the last two dims of x."""
    xf = x.to(torch.float32).numpy()
    if xf.ndim == 1 or block[0] == 1:
        flat = xf.reshape(-1, xf.shape[-1])
    else:
        flat = xf.reshape(-1, *xf.shape[-2:])
    br, bk = block
    if block[0] == 1:
        blocks = flat.reshape(flat.shape[0], -1, bk)
        amax = np.abs(blocks).max(-1)
    else:
        n, rows, k = flat.shape
        pad = (-rows) % br
        padded = np.concatenate([flat, np.zeros((n, pad, k), F32)], axis=1)
        blocks = padded.reshape(n, (rows + pad) // br, br, k // bk, bk)
        amax = np.abs(blocks).max(axis=(2, 4))
    amax = np.maximum(amax, F32(1e-4))
    sf = (amax / F32(448.0)).astype(F32)
    if ue8m0:  # DeepGEMM ceil_to_ue8m0: exponent + (mantissa != 0), clamped to [1, 254]
        bits = sf.view(np.uint32)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
        sf = (np.clip(exp, 1, 254).astype(np.uint32) << 23).view(F32)
    inv = (F32(1.0) / sf).astype(F32)
    if block[0] == 1:
        scaled = blocks * inv[..., None]
        data = scaled.reshape(flat.shape)
    else:
        scaled = blocks * inv[:, :, None, :, None]
        data = scaled.reshape(n, rows + pad, k)[:, :rows]
    codes = np.clip(data, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    scale_shape = (
        (*xf.shape[:-1], xf.shape[-1] // bk)
        if block[0] == 1
        else (*xf.shape[:-2], amax.shape[-2], amax.shape[-1])
    )
    return codes.reshape(xf.shape), sf.reshape(scale_shape)


SUITE = list(cases.suite(cases.SHAPES_FP8_BLOCK))


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
@pytest.mark.parametrize("block", [(128, 128), (1, 128)], ids=["128x128", "1x128"])
@pytest.mark.parametrize(("label", "x"), SUITE, ids=[s[0] for s in SUITE])
def test_matches_deepgemm_transcription(label, x, block, ue8m0):
    """Byte for byte, except where DeepGEMM's ue8m0 element times its scale 2^120 overflows to
    Inf (the all-max inputs): there mxrl stores 240, not 256 (tests/formats/test_finite_range.py)."""
    q = quantize(x, "fp8_block", block=block, scale_mode="ue8m0" if ue8m0 else "fp32")
    data, sf = deepgemm_numpy(x, block, ue8m0)
    top = _per_element(torch.from_numpy(sf.copy()) == 2.0**120, block, x.shape)
    assert_e4m3_equal_but_top(q.qdata, torch.from_numpy(data.copy()), top, f"{label} data")
    assert_bytes_equal(q.scale, torch.from_numpy(sf.copy()), f"{label} scale")
    assert q.block == block or (block[0] > 1 and x.shape[-2] == 1)


def _per_element(block_mask: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """A per-block bool [..., R/br, K/bk] spread over the elements [..., R, K]."""
    br, bk = block
    out = block_mask.repeat_interleave(bk, dim=-1)
    if br > 1:
        out = out.repeat_interleave(br, dim=-2)[..., : shape[-2], :]
    return out.reshape(shape)


def test_partial_row_block_and_amax_floor():
    x = cases.randn((130, 256), torch.float32, seed=3)
    x[128:] = 0.0  # the partial last row-block is all zero: its amax is floored at 1e-4
    q = quantize(x, "fp8_block")
    assert q.scale.shape == (2, 2)
    floor = torch.div(torch.tensor(1e-4), torch.tensor(448.0))
    assert_bytes_equal(q.scale[1], floor.expand(2).contiguous(), "floored scale")
    assert (q.qdata[128:] == 0).all()


@pytest.mark.parametrize("block", [(128, 128), (1, 128)])
def test_sqnr_and_dequantize(block):
    x = cases.randn((256, 512), torch.bfloat16, seed=8)
    q = quantize(x, "fp8_block", block=block)
    assert sqnr_db(x.float(), dequantize(q)) >= 28.0
    assert dequantize(q).dtype == torch.float32 and dequantize(q).shape == x.shape


@pytest.mark.parametrize("block", [(128, 128), (1, 128)], ids=["128x128", "1x128"])
def test_non_finite_elements_are_nan_and_leave_the_scale_alone(block):
    """docs/formats.md, "Non-finite inputs": the block amax ignores NaN and ±Inf (before, one
    Inf made scale = inf and the whole block dequantize to NaN), NaN and ±Inf encode 0x7F
    (not 448). tests/formats/test_non_finite.py has the full table."""
    x = cases.randn((130, 256), torch.float32, seed=4)
    bad = torch.zeros_like(x, dtype=torch.bool)
    for (r, c), v in (((3, 7), math.nan), ((64, 200), math.inf), ((129, 128), -math.inf)):
        x[r, c] = v
        bad[r, c] = True
    q = quantize(x, "fp8_block", block=block)
    clean = quantize(torch.where(bad, 0.0, x), "fp8_block", block=block)
    assert_bytes_equal(q.scale, clean.scale, "scales")
    assert torch.isfinite(q.scale).all()
    assert (q.qdata[bad] == 0x7F).all()
    assert_bytes_equal(q.qdata[~bad], clean.qdata[~bad], "finite elements")
    deq = dequantize(q)
    assert torch.isnan(deq[bad]).all()
    assert_bytes_equal(deq[~bad], dequantize(clean)[~bad], "finite values")


def test_ue8m0_scales_are_powers_of_two_not_below_fp32_scale():
    x = cases.randn((256, 256), torch.float32, seed=9)
    sf = quantize(x, "fp8_block").scale
    pow2 = quantize(x, "fp8_block", scale_mode="ue8m0").scale
    assert ((pow2.view(torch.int32) & 0x7FFFFF) == 0).all()
    assert (pow2 >= sf).all() and (pow2 < 2 * sf).all()


@pytest.mark.parametrize(
    ("shape", "block"),
    [((256, 384), (128, 128)), ((2, 256, 128), (128, 128)), ((200, 256), (128, 128)),
     ((64, 256), (1, 128)), ((96, 64), (32, 32))],
)  # fmt: skip
def test_dequantize_is_each_code_times_its_block_scale(shape, block):
    """deq[r, c] = e4m3(code[r, c]) * scale[r // br, c // bk], written out with NumPy and
    ml_dtypes (rows that divide into blocks take a transpose-free path, others pad)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 10
    q = quantize(x, "fp8_block", block=block)
    codes = q.qdata.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(F32)
    br, bk = block
    scale = q.scale.numpy().repeat(br, axis=-2).repeat(bk, axis=-1)[..., : shape[-2], :]
    assert_bytes_equal(dequantize(q), torch.from_numpy(codes * scale), f"{shape} {block}")


@pytest.mark.parametrize("shape", [(256, 384), (3, 128, 256)])
def test_square_blocks_transpose_to_the_quantization_of_the_transpose(shape):
    """A square block of w^T holds the elements of one block of w: quantizing w^T gives w's
    codes and scales transposed, byte for byte (the quantized backward's dgrad operand)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])
    got = transpose_square_blocks(quantize(w, "fp8_block", block=(128, 128)))
    want = quantize(w.transpose(-2, -1).contiguous(), "fp8_block", block=(128, 128))
    assert got.shape == want.shape and got.block == (128, 128)
    assert_bytes_equal(got.qdata, want.qdata, "codes")
    assert_bytes_equal(got.scale, want.scale, "scales")


def test_transpose_square_blocks_refuses_partial_and_row_blocks():
    with pytest.raises(ValueError, match=r"\(200, 128\) in \(128, 128\)"):
        transpose_square_blocks(quantize(torch.randn(200, 128), "fp8_block", block=(128, 128)))
    with pytest.raises(ValueError, match=r"in \(1, 128\)"):
        transpose_square_blocks(quantize(torch.randn(4, 128), "fp8_block", block=(1, 128)))
