"""The NVFP4 global amax of a weight (mxrl.recipe.quantize.weight_amax), against the amax over
finite elements written out here (a masked |w|): both paths — the one-read path the export takes
for checked-finite masters, and the training path, which zeroes NaN/Inf first — for a 2-D weight
with its fuse partner, a fused 3-D gate_up (gate and up halves apart) and a 3-D down, fp32 and
bf16, with and (training path) without non-finite elements."""

from __future__ import annotations

import math

import pytest
import torch

from mxrl.recipe import TensorSpec
from mxrl.recipe.quantize import own_weight_amax, weight_amax
from tests.numerics import assert_bytes_equal


def _spec(name, shape, role, fuse_group=None):
    return TensorSpec(
        name=name, shape=shape, kind="routed_expert" if len(shape) == 3 else "dense_mlp",
        layer=0, expert=None, role=role, format="nvfp4", activations="per_token",
        fuse_group=fuse_group,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "role", "partnered"),
    [((64, 48), "gate", True), ((64, 48), "down", False), ((4, 32, 16), "gate_up", False),
     ((4, 16, 32), "down", False)],
)  # fmt: skip
def test_both_amax_paths_are_the_masked_amax(dtype, shape, role, partnered):
    g = torch.Generator().manual_seed(len(shape) * 7 + shape[-1])
    w = torch.randn(shape, generator=g) * torch.rand(shape[:-1], generator=g)[..., None] * 5
    w = w.to(dtype)
    w.view(-1)[3] = -40.0  # the max magnitude on a negative element
    w.view(-1)[5] = -0.0
    partner = (torch.randn(shape, generator=g) * 9).to(dtype) if partnered else None
    spec = _spec("model.layers.0.mlp.x.weight", shape, role, "g" if partnered else None)
    want = _masked_amax(w, role, partner)
    fast = weight_amax(w, spec, partner, finite=True)
    assert fast.dtype == torch.float32 and fast.shape == want.shape
    assert_bytes_equal(fast, want, "one read")
    assert_bytes_equal(weight_amax(w, spec, partner), want, "training path")
    # non-finite elements: the training path skips them, as the masked amax does
    w.view(-1)[7], w.view(-1)[-1], w.view(-1)[11] = math.nan, math.inf, -math.inf
    if partner is not None:
        partner.view(-1)[0] = math.nan
    assert_bytes_equal(weight_amax(w, spec, partner), _masked_amax(w, role, partner), "masked")


def _masked_amax(w, role, partner):
    """max |w| over finite elements, written out: per tensor (2-D, with the fuse partner), per
    expert (3-D), per half (a fused gate_up without a fuse group)."""

    def amax(t, dims):
        mag = torch.where(torch.isfinite(t), t.float().abs(), torch.zeros((), dtype=torch.float32))
        return mag.amax() if dims is None else mag.amax(dim=dims, keepdim=True)

    if w.dim() == 2:
        out = amax(w, None)
        return out if partner is None else torch.maximum(out, amax(partner, None))
    if role == "gate_up":
        half = w.shape[1] // 2
        gate = amax(w[:, :half], (1, 2)).expand(-1, half, 1)
        return torch.cat([gate, amax(w[:, half:], (1, 2)).expand(-1, half, 1)], dim=1)
    return amax(w, (1, 2))


def test_an_all_non_finite_weight_has_a_zero_amax():
    w = torch.full((4, 16, 32), math.nan)
    w[1] = math.inf
    spec = _spec("model.layers.0.mlp.experts.down_proj", (4, 16, 32), "down")
    assert_bytes_equal(weight_amax(w, spec), torch.zeros(4, 1, 1), "amax")


def test_the_masked_amax_skips_non_finite_elements():
    w = torch.randn(8, 16)
    w[1, 2], w[5, 5] = float("nan"), float("inf")
    spec = _spec("model.layers.0.mlp.down_proj.weight", (8, 16), "down")
    finite = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
    assert weight_amax(w, spec).item() == finite.abs().max().item()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "role", "index", "hit"),
    [((64, 48), "down", (63, 47), ()), ((4, 32, 16), "gate_up", (2, 5, 0), (2, 0, 0)),
     ((4, 32, 16), "gate_up", (3, 16, 15), (3, 16, 0)), ((4, 16, 32), "down", (1, 15, 31), (1, 0, 0))],
)  # fmt: skip
def test_the_one_read_amax_propagates_nan_and_inf(shape, role, index, hit, dtype, bad):
    # the export's NaN/Inf check of an NVFP4 master is its own amax (mxrl.weights.export):
    # the bad element's expert / half gets a non-finite amax, the others keep theirs
    w = torch.randn(shape).to(dtype)
    w[index] = bad
    spec = _spec("model.layers.0.mlp.x.weight", shape, role)
    amax = own_weight_amax(w, spec, finite=True)
    assert_bytes_equal(amax, weight_amax(w, spec, finite=True), "own = weight_amax unpartnered")
    bad_at = (~torch.isfinite(amax)).nonzero().tolist()
    if len(shape) == 3 and role == "gate_up":  # [E, 2I, 1]: every row of the bad half
        half = shape[1] // 2
        start = hit[1] // half * half
        assert bad_at == [[hit[0], r, 0] for r in range(start, start + half)]
    else:
        assert bad_at == [list(hit)]
    assert not math.isnan(bad) or torch.isnan(amax[hit]).item()
