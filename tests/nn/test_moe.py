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
from mxrl.nn.paths.permute import ExpertLayout
from mxrl.nn.paths.rollout import ExpertGroups, Grouping, RolloutPath
from tests.nn.test_qmatmul import _expert_specs
from tests.numerics import assert_bytes_equal

T, K, E, H, INTER = 9, 3, 5, 16, 8


def _inputs(dtype):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).to(dtype)
    # distinct experts per token, as top-k routes (a bf16 loop adds a token's rows for one
    # expert within one index_add_, which rounds a repeated expert's sum differently)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g).to(dtype)
    w = {
        "gate_up": torch.randn(E, 2 * INTER, H, generator=g).to(dtype),
        "down": torch.randn(E, H, INTER, generator=g).to(dtype),
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
        return torch.cat(
            [_row_exact(r[None], w[which][e]) for r, e in zip(rows, expert_of_row, strict=True)]
        )

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


def _loop_by_hand(x, ids, weights, w, expert_dtype):
    """Each token's expert outputs (in `expert_dtype`) times their weights rounded to that
    dtype, added to the token's row (x's dtype) in ascending expert order, ties (a repeated
    expert) in slot order."""
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):  # stable
            e = int(ids[t, j])
            h = _row_exact(x[t : t + 1].to(expert_dtype), w[e])[0]
            want[t] = want[t] + (h * weights[t, j].to(expert_dtype)).to(x.dtype)
    return want


def test_the_loop_adds_each_experts_rounded_outputs_in_expert_order():
    """bf16 tokens, fp32 routing weights (the router's), the loop against the sums written out
    (`_loop_by_hand`). Expert 0 gets no token, expert 1 exactly one, expert 3 none."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, H, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[2, 4], [4, 2], [1, 2], [2, 4]])
    weights = torch.rand(4, 2, generator=g)
    w = torch.randn(E, H, H, generator=g).to(torch.bfloat16)
    calls = []

    def expert(e, x_nH):
        calls.append(e)
        return _row_exact(x_nH, w[e])

    got = moe_loop(x, ids, weights, E, expert)
    assert calls == [1, 2, 4] and got.dtype == torch.bfloat16
    assert_bytes_equal(got, _loop_by_hand(x, ids, weights, w, torch.bfloat16), "loop")


@pytest.mark.parametrize("expert_dtype", [torch.float32, torch.bfloat16])
def test_the_loop_keeps_a_repeated_experts_slot_order_and_the_tokens_dtype(expert_dtype):
    """Routing replay may repeat an expert in a token's k slots: its rows are added in slot
    order (the sort is stable; an unstable one reorders ties at this size, and fp32 sums of
    three fp32 outputs then differ). An expert computing in bf16 (as under autocast) leaves the
    tokens and the result in fp32."""
    g = torch.Generator().manual_seed(1)
    t, k = 300, 3
    x = torch.randn(t, H, generator=g)
    ids = torch.randint(0, 4, (t, k), generator=g)
    weights = torch.rand(t, k, generator=g)
    w = torch.randn(4, H, H, generator=g).to(expert_dtype)

    def expert(e, x_nH):
        return _row_exact(x_nH.to(expert_dtype), w[e])

    got = moe_loop(x, ids, weights, 4, expert)
    assert got.dtype == torch.float32
    assert_bytes_equal(got, _loop_by_hand(x, ids, weights, w, expert_dtype), "loop")


def test_the_grouped_form_returns_the_tokens_dtype():
    """fp32 tokens through bf16 grouped GEMMs (the tensor-core path's): the result in fp32."""
    x, ids, weights, w = _inputs(torch.float32)
    groups = ExpertGroups.build(ids, E, Backend.REFERENCE)
    expert_of_row = torch.repeat_interleave(torch.arange(E), torch.diff(groups.offsets.long()))

    def project(which, rows):
        rows = rows.to(torch.bfloat16)
        return torch.cat(
            [
                _row_exact(r[None], w[which][e].bfloat16())
                for r, e in zip(rows, expert_of_row, strict=True)
            ]
        )

    got = moe_grouped(x, weights, groups, project)
    assert got.dtype == torch.float32
    gate, up = project("gate_up", groups.gather(x)).chunk(2, dim=-1)
    h = project("down", invariant.silu_mul(gate, up))
    assert_bytes_equal(got, groups.combine(h, weights).float(), "fp32 out")


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
