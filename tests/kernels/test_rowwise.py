"""The fused row-wise kernels of the decode step (mxrl.kernels.rowwise) under Triton's
interpreter: RMSNorm within one rounding of its reference and batch invariant bit for bit; the
experts' combine and RoPE the same bytes as the eager ops; the experts' grouping the same
integers as the sort-based reference."""

from __future__ import annotations

import pytest
import torch

from mxrl.kernels.rowwise import (
    _moe_group_launch,
    moe_combine,
    moe_combine_reference,
    moe_group_reference,
    rms_norm,
    rms_norm_reference,
    rope,
    rope_reference,
)
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


def _routing(t, k, e, seed, duplicates=False):
    g = torch.Generator().manual_seed(seed)
    if duplicates:  # routing replay does not promise distinct experts: ties keep slot order
        return torch.randint(0, e, (t, k), generator=g)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])


@interpreter
@pytest.mark.parametrize(
    ("t", "k", "e", "duplicates"),
    [
        (1, 8, 128, False),
        (13, 8, 128, False),
        (37, 2, 16, False),
        (20, 4, 6, True),
        (3, 3, 5, True),
    ],
)
def test_moe_group_gives_the_sorted_references_integers(t, k, e, duplicates):
    ids = _routing(t, k, e, seed=t + k, duplicates=duplicates)
    got = _moe_group_launch(ids, e)
    want = moe_group_reference(ids, e)
    for name, a, b in zip(("offsets", "order", "token_of", "rows"), got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, a, b)
    # what the combine relies on: each token's rows ascending, holding that token's entries
    offsets, _, token_of, rows = got
    assert (rows.diff(dim=1) > 0).all()
    assert torch.equal(token_of[rows], torch.arange(t)[:, None].expand(t, k))
    assert int(offsets[-1]) == t * k and (offsets.diff() >= 0).all()


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32: the reference
@pytest.mark.parametrize("d", [128, 16])
def test_rope_gives_the_eager_bytes(dtype, d):
    """q and k as the model hands them over (transposed views of [1, S, heads, D]), the angles
    in the compute dtype as the model's RotaryEmbedding gives them."""
    from mxrl.models.layers import RotaryEmbedding

    g = torch.Generator().manual_seed(d)
    s, n, nk = 7, 4, 2
    q = (torch.randn(1, s, n, d, generator=g) * 4).to(dtype).transpose(1, 2)
    k = (torch.randn(1, s, nk, d, generator=g) * 4).to(dtype).transpose(1, 2)
    positions = torch.tensor([[0, 1, 2, 9, 100, 4095, 70000]])
    cos, sin = RotaryEmbedding(d, 1e6)(positions, dtype)
    got, want = rope(q, k, cos, sin), rope_reference(q, k, cos, sin)
    for name, a, b in zip(("q", "k"), got, want, strict=True):
        assert a.shape == b.shape
        assert_bytes_equal(a.contiguous(), b.contiguous(), name)
