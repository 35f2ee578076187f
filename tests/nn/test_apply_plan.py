"""apply_plan on the built-in tiny MoE (4 layers, 8 experts, a shared expert): what is swapped,
what the recipe keeps in high precision, and that training still learns under every preset."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mxrl.arch import builtin_config
from mxrl.models import build_model
from mxrl.nn import GroupedExperts, QExperts, QLinear, apply_plan, swap_table
from mxrl.recipe import resolve
from tests.numerics import assert_bytes_equal

ARTICLE_PRESETS = [
    "bf16",
    "mxfp8",
    "mxfp8-hp",
    "mxfp8-dequantized",
    "nvfp4-hp",
    "nvfp4-dequantized",
]


def tiny(seed=0, **overrides):
    return build_model({**builtin_config("tiny-moe"), **overrides}, seed=seed)


def plan_for(model, preset):
    return resolve(preset, {n: p.shape for n, p in model.named_parameters()})


@pytest.mark.parametrize("preset", ARTICLE_PRESETS)
def test_recipe_exceptions_stay_high_precision(preset):
    model = tiny()
    swaps = apply_plan(model, plan_for(model, preset))
    last = model.model.layers[-1]  # "last 15%" of 4 layers = layer 3
    assert not any(isinstance(m, QLinear | QExperts) for m in last.modules())
    for layer in model.model.layers:
        mlp = layer.mlp
        assert type(mlp.shared_expert.gate_proj) is nn.Linear  # shared experts: bf16
        assert type(mlp.shared_expert_gate) is nn.Linear and type(mlp.gate) is nn.Linear
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    first = model.model.layers[0]
    if preset == "bf16":
        assert swaps == [] and "no module swapped" in swap_table(swaps)
    elif preset.startswith("nvfp4"):
        assert isinstance(first.mlp.experts, QExperts)
        assert type(first.self_attn.q_proj) is nn.Linear  # attention under NVFP4: bf16
        assert {s.new_type for s in swaps} == {"QExperts"} and len(swaps) == 3
    else:
        assert isinstance(first.mlp.experts, QExperts)
        assert isinstance(first.self_attn.q_proj, QLinear)
        assert len(swaps) == 3 * (4 + 1)  # q, k, v, o and experts of layers 0-2


def test_apply_plan_keeps_parameters_and_state_dict():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: id(p) for n, p in model.named_parameters()}
    apply_plan(model, plan_for(model, "nvfp4-dequantized"))
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        assert_bytes_equal(after[k], before[k], k)
    assert {n: id(p) for n, p in model.named_parameters()} == params  # same Parameter objects


def test_bf16_plan_leaves_logits_unchanged_and_quantized_plans_change_them():
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = tiny()(ids)
    same = tiny()
    apply_plan(same, plan_for(same, "bf16"))
    assert_bytes_equal(same(ids), ref, "bf16 plan")
    for preset in ("mxfp8", "nvfp4-dequantized"):
        q = tiny()
        apply_plan(q, plan_for(q, preset))
        out = q(ids)
        assert not torch.equal(out, ref)
        torch.testing.assert_close(out, ref, rtol=0.2, atol=0.2)  # close, not equal


def test_plan_for_another_model_is_refused():
    model = tiny()
    other = tiny(num_hidden_layers=5)
    with pytest.raises(ValueError, match=r"does not fit this model.*model\.layers\.4"):
        apply_plan(model, plan_for(other, "mxfp8"))
    apply_plan(model, plan_for(model, "mxfp8"))
    with pytest.raises(ValueError, match="already quantized"):
        apply_plan(model, plan_for(model, "mxfp8"))


def test_quantized_embedding_is_refused_by_name():
    model = tiny()
    recipe = {"name": "emb", "rules": [{"match": {"kind": "embedding"}, "format": "mxfp8"}]}
    plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
    with pytest.raises(ValueError, match=r"embed_tokens\.weight.*no quantized Embedding"):
        apply_plan(model, plan)


def test_experts_are_grouped_experts_before_the_plan():
    assert isinstance(tiny().model.layers[0].mlp.experts, GroupedExperts)


# fp8-block's 128-wide blocks need K % 128 == 0: a wider variant of the tiny model.
WIDE = {
    "hidden_size": 128,
    "head_dim": 32,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}


@pytest.mark.parametrize("preset", [*ARTICLE_PRESETS, "fp8-block", "fp8-block-quantized"])
def test_a_few_optimizer_steps_lower_the_loss(preset):
    torch.manual_seed(0)
    model = tiny(seed=1, **(WIDE if preset.startswith("fp8-block") else {}))
    swaps = apply_plan(model, plan_for(model, preset))
    assert (len(swaps) > 0) == (preset != "bf16")
    losses = training_losses(model)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5, losses


def training_losses(model: nn.Module, steps: int = 8) -> list[float]:
    """Next-token losses of `steps` AdamW steps (lr 3e-3) on one seeded batch of 4 x 24 tokens
    of a 64-token vocabulary: a model that trains brings them down."""
    ids = torch.randint(1, 64, (4, 24), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
