"""The fused row-wise kernels of the decode step (mxrl.kernels.rowwise) under Triton's
interpreter: RMSNorm within one rounding of its reference and batch invariant bit for bit; the
experts' combine and RoPE the same bytes as the eager ops; the experts' grouping the same
integers as the sort-based reference; the router's softmax top-k the reference's ids (its tie
rule where the reference's probabilities tie) with weights within the stated bound. The GPU tier
(`gpu` marker) compares the router's kernel with its reference on CUDA."""

from __future__ import annotations

import pytest
import torch

from mxrl.kernels.rowwise import (
    MAX_ROUTE_EXPERTS,
    _moe_group_launch,
    moe_combine,
    moe_combine_reference,
    moe_group_reference,
    moe_route,
    moe_route_reference,
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


# --- the router's softmax top-k -----------------------------------------------------------------

# (T, E, k): Qwen3-30B-A3B (128, 8), Qwen1.5-MoE-A2.7B (60, 4), the tiny test model (8, 2), the
# widest row one program takes, every expert chosen, one expert
ROUTER_SHAPES = [(9, 128, 8), (7, 60, 4), (11, 8, 2), (5, 512, 8), (4, 16, 16), (6, 32, 1)]


def _router_logits(t, e, dtype, scale, seed):
    """Logits at `scale` (large: peaked rows, whose chosen experts lie far below the max); in
    bf16, equal logits (and so tied probabilities) are common."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, e, generator=g) * scale).to(dtype)


def _weight_bound(logits, ids, want, out_dtype):
    """rowwise.moe_route's stated bound: (3|y| + E/4 + 64) 2^-24 relative before the cast
    (y = logit - row max), 2^-126 absolute, one rounding of the output dtype after it."""
    x = logits.float()
    y = (x.gather(1, ids) - x.max(dim=1, keepdim=True).values).abs()
    rel = (3 * y + x.shape[1] / 4 + 64) * 2.0**-24
    if out_dtype != torch.float32:
        rel = rel + torch.finfo(out_dtype).eps
    return rel * want.float().abs() + 2.0**-126


def _check_route(logits, k, norm, out_dtype=torch.float32):
    """The documented contract of moe_route against its reference, on every row."""
    ids, w = moe_route(logits, k, norm, out_dtype=out_dtype)
    want_ids, want_w = moe_route_reference(logits, k, norm, out_dtype)
    assert ids.dtype == torch.int64 and ids.shape == want_ids.shape
    assert w.dtype == out_dtype and w.shape == want_w.shape
    # the kernel's rule, exactly: the k largest logits, ties to the lower index
    rule = torch.sort(logits.float(), dim=1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids, rule)
    # a choice the reference allows: its probabilities at these ids are its top-k values
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top = torch.topk(probs, min(k + 1, logits.shape[1]), dim=-1).values
    assert torch.equal(probs.gather(1, ids), top[:, :k])
    # and its ids wherever its k+1 largest probabilities are distinct
    distinct = (top.diff(dim=1) != 0).all(dim=1)
    assert torch.equal(ids[distinct], want_ids[distinct])
    # weights position by position (equal probabilities in either order: equal weights)
    err = (w.float() - want_w.float()).abs()
    bound = _weight_bound(logits, ids, want_w, out_dtype)
    assert (err <= bound).all(), (err / bound).max()
    return ids, w, distinct


@interpreter
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(("t", "e", "k"), ROUTER_SHAPES)
def test_moe_route_gives_the_references_ids_and_weights_within_the_bound(t, e, k, norm):
    for seed, scale in enumerate((1.0, 8.0)):
        logits = _router_logits(t, e, torch.float32, scale, seed=e + k + seed)
        _, _, distinct = _check_route(logits, k, norm)
        if k < e:  # random fp32 logits: no tied probabilities, every row checked for its ids
            assert distinct.all()


@interpreter
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("t", "e", "k"), [(9, 128, 8), (11, 8, 2)])
def test_moe_route_from_bf16_logits_with_ties(t, e, k, out_dtype):
    """The bf16 engine's router: tied logits take the lower expert first; weights in bf16 are
    within one bf16 rounding of the reference's."""
    logits = _router_logits(t, e, torch.bfloat16, 2.0, seed=5)
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1  # a tie for the first place
    for norm in (True, False):
        ids, _, _ = _check_route(logits, k, norm, out_dtype)
        assert ids[0, 0] == 3 and ids[0, 1] == 7


@interpreter
def test_moe_route_rows_do_not_depend_on_the_batch():
    logits = _router_logits(13, 128, torch.bfloat16, 3.0, seed=2)
    ids, w = moe_route(logits, 8, True, out_dtype=torch.bfloat16)
    for r in (0, 6, 12):
        one_ids, one_w = moe_route(logits[r : r + 1], 8, True, out_dtype=torch.bfloat16)
        assert_bytes_equal(one_ids, ids[r : r + 1], f"row {r} ids")
        assert_bytes_equal(one_w, w[r : r + 1], f"row {r} weights")
    # a row of a strided view (the logits' row stride is the launcher's business)
    wide = torch.cat([logits, logits], dim=1)[:, :128]
    assert_bytes_equal(moe_route(wide, 8, True, out_dtype=torch.bfloat16)[1], w, "strided")
    assert moe_route(logits[:0], 8, True)[0].shape == (0, 8)


@interpreter
@pytest.mark.parametrize(
    ("logits", "k", "out_dtype", "match"),
    [
        (torch.zeros(2, MAX_ROUTE_EXPERTS + 1), 8, torch.float32, "at most 512"),
        (torch.zeros(2, 8), 9, torch.float32, "top_k must be in"),
        (torch.zeros(2, 8), 0, torch.float32, "top_k must be in"),
        (torch.zeros(2, 8, dtype=torch.float64), 2, torch.float32, "want \\[T, E\\]"),
        (torch.zeros(2, 8, dtype=torch.int64), 2, torch.float32, "want \\[T, E\\]"),
        (torch.zeros(1, 2, 8), 2, torch.float32, "flatten the batch dims"),
        (torch.zeros(2, 8), 2, torch.int32, "out_dtype must be"),
    ],
)
def test_moe_route_refuses_what_it_cannot_take(logits, k, out_dtype, match):
    with pytest.raises(ValueError, match=match):
        moe_route(logits, k, True, out_dtype=out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("t", "e", "k"), [(1, 128, 8), (64, 128, 8), (33, 60, 4), (5, 512, 8)])
def test_moe_route_on_cuda_matches_its_reference(t, e, k, out_dtype):
    """The compiled kernel (the GPU's exp, IEEE division) against the reference on CUDA: the
    same contract as under the interpreter, and a row alone its bytes in the batch."""
    for norm in (True, False):
        for dtype in (torch.float32, torch.bfloat16):
            logits = _router_logits(t, e, dtype, 4.0, seed=t + e).cuda()
            ids, w, _ = _check_route(logits, k, norm, out_dtype)
            one_ids, one_w = moe_route(logits[-1:], k, norm, out_dtype=out_dtype)
            assert_bytes_equal(one_ids, ids[-1:], "ids alone")
            assert_bytes_equal(one_w, w[-1:], "weights alone")
