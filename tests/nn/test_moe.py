"""The routed experts' one dispatch (mxrl/nn/moe.py): the grouped form's two combine orders
against sums written out by hand (the engine's in ascending expert order, the loop's bytes; the
trainer's in slot order), and the engine path's choice of a grouped form by format."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mxrl.kernels import Backend
from mxrl.nn import invariant
from mxrl.nn.moe import moe_grouped, moe_loop
from mxrl.nn.paths.grouped import ExpertLayout
from mxrl.nn.paths.rollout import ExpertGroups, Grouping, RolloutPath
from tests.nn.test_qmatmul import _expert_specs
from tests.numerics import assert_bytes_equal

T, K, E, H, I = 9, 3, 5, 16, 8


def _inputs(dtype):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).to(dtype)
    # distinct experts per token, as top-k routes (a bf16 loop adds a token's rows for one
    # expert within one index_add_, which rounds a repeated expert's sum differently)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g).to(dtype)
    w = {
        "gate_up": torch.randn(E, 2 * I, H, generator=g).to(dtype),
        "down": torch.randn(E, H, I, generator=g).to(dtype),
    }
    return x, ids, weights, w


def _row_exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T row by row in float64, rounded once: a row's result whatever rows run beside it
    (so the grouped and loop forms see the same projections)."""
    return (x.double() @ w.double().T).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_grouped_form_gives_the_loops_bytes(dtype):
    """`ExpertGroups` combines each token's k outputs in ascending expert order, the order
    the loop's `index_add_` adds them: the grouped form equals the loop byte for byte."""
    x, ids, weights, w = _inputs(dtype)
    groups = ExpertGroups.build(ids, E, Backend.REFERENCE)
    expert_of_row = torch.repeat_interleave(torch.arange(E), torch.diff(groups.offsets.long()))

    def project(which, rows):
        return torch.cat([_row_exact(r[None], w[which][e]) for r, e in zip(rows, expert_of_row)])

    def expert(e, x_nH):
        gate, up = _row_exact(x_nH, w["gate_up"][e]).chunk(2, dim=-1)
        return _row_exact(invariant.silu_mul(gate, up), w["down"][e])

    got = moe_grouped(x, weights, groups, project)
    assert_bytes_equal(got, moe_loop(x, ids, weights, E, expert), "grouped vs loop")


def test_the_trainers_grouped_form_sums_each_token_in_slot_order():
    """`ExpertLayout`: x's rows gathered in the stable expert order; each token's outputs
    weighted and summed over its slots j = 0..k-1, written out here."""
    x, ids, weights, _ = _inputs(torch.float32)
    layout = ExpertLayout.build(ids, E)
    order = torch.argsort(ids.reshape(-1), stable=True)
    assert_bytes_equal(layout.gather(x), x[order // K], "gather")
    h = torch.randn(T * K, H)  # row r: the output of sorted row r
    row_of = {int(flat): r for r, flat in enumerate(order)}  # flat index t * k + j -> row
    want = torch.stack(
        [
            torch.stack([h[row_of[t * K + j]] * weights[t, j] for j in range(K)]).sum(0)
            for t in range(T)
        ]
    )
    assert_bytes_equal(layout.combine(h, weights), want, "combine")


def _specs(fmt, **kw):
    gate_up, down = _expert_specs(fmt, e=4, h=128, i=128)
    return {k: dataclasses.replace(s, **kw) for k, s in (("gate_up", gate_up), ("down", down))}


@pytest.mark.parametrize(
    ("fmt", "kw", "dtype", "want"),
    [
        ("mxfp8", {}, torch.float32, Grouping.LOW_BIT),
        ("nvfp4", {}, torch.bfloat16, Grouping.LOW_BIT),  # per-token activation scales
        ("nvfp4", {"activations": "per_tensor"}, torch.bfloat16, None),  # a scale across experts
        ("fp8_block", {}, torch.float32, Grouping.FP8_BLOCK),
        ("fp8_block", {}, torch.bfloat16, Grouping.FP8_BLOCK),
        ("fp8_block", {}, torch.float16, None),
        ("fp8_block", {"block": (1, 128)}, torch.float32, None),
        ("bf16", {}, torch.float32, None),  # bf16 weights computed in fp32: the loop
    ],
)
def test_the_rollout_path_runs_experts_grouped_by_their_formats(fmt, kw, dtype, want):
    specs = _specs(fmt, **kw)
    assert RolloutPath(8, Backend.TRITON).grouping(specs, dtype) is want
    assert RolloutPath(8, Backend.REFERENCE).grouping(specs, dtype) is None


def test_mixed_expert_formats_run_the_loop():
    specs = {"gate_up": _specs("mxfp8")["gate_up"], "down": _specs("bf16")["down"]}
    assert RolloutPath(8, Backend.TRITON).grouping(specs, torch.bfloat16) is None


def test_bf16_experts_run_grouped_in_bf16_on_hopper_only():
    """torch._grouped_mm needs sm90+: on a machine without one, bf16 experts run the loop."""
    want = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    got = RolloutPath(8, Backend.TRITON).grouping(_specs("bf16"), torch.bfloat16)
    assert got is (Grouping.BF16 if want else None)
