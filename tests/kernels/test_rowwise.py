"""The fused row-wise kernels of the decode step (mxrl.kernels.rowwise) under Triton's
interpreter: RMSNorm within one rounding of its reference and batch invariant bit for bit; the
experts' combine the same bytes as the eager loop."""

from __future__ import annotations

import pytest
import torch

from mxrl.kernels.rowwise import moe_combine, moe_combine_reference, rms_norm, rms_norm_reference
from tests.kernels.test_decode_gemm import interpreter
from tests.numerics import assert_bytes_equal


def _x(rows, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, generator=g) * torch.rand(rows, 1, generator=g).mul(8)
    w = torch.randn(h, generator=g) * 0.5 + 1
    return x.to(dtype), w.to(dtype)


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h", [128, 96, 2048])
def test_rms_norm_is_within_one_rounding_of_the_reference(dtype, h):
    x, w = _x(9, h, dtype)
    got, want = rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    # the statistics differ in summation order only (fp32, relative 2^-18 at most here): then
    # at most one more rounding of the output dtype, twice (the cast back, the weight's product)
    eps = torch.finfo(dtype).eps
    err = (got.float() - want.float()).abs()
    assert (err <= (2 * eps + 2**-18) * want.float().abs()).all(), err.max()


@interpreter
def test_rms_norm_rows_do_not_depend_on_the_batch():
    x, w = _x(13, 256, torch.bfloat16, seed=1)
    batch = rms_norm(x, w, 1e-6)
    for r in (0, 5, 12):
        assert_bytes_equal(rms_norm(x[r : r + 1], w, 1e-6), batch[r : r + 1], f"row {r}")
    heads = rms_norm(x.view(13, 2, 128), w[:128], 1e-6)  # per-head q/k norm: [T, N, D]
    assert_bytes_equal(heads[3, 1], rms_norm(x[3, 128:][None], w[:128], 1e-6)[0], "a head")


@interpreter
def test_rms_norm_refuses_a_weight_of_another_dtype():
    x, w = _x(2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, w.float(), 1e-6)


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_combine_gives_the_eager_loops_bytes(dtype):
    g = torch.Generator().manual_seed(3)
    t, k, hdim = 11, 4, 80
    h = (torch.randn(t * k, hdim, generator=g) * 3).to(dtype)
    w = torch.rand(t * k, generator=g).to(dtype)
    row_of = torch.randperm(t * k, generator=g).view(t, k)
    assert_bytes_equal(moe_combine(h, w, row_of), moe_combine_reference(h, w, row_of), "combine")
    # a token's sum does not depend on the other tokens
    assert_bytes_equal(moe_combine(h, w, row_of[4:5]), moe_combine(h, w, row_of)[4:5], "alone")
