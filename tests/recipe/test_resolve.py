"""Resolving recipes: every preset on Qwen3-30B-A3B, shared experts, MLA, both expert layouts,
and the errors a wrong recipe meets."""

from __future__ import annotations

from functools import cache

import pytest

from mxrl.arch import Kind, builtin_config
from mxrl.arch import tensors_from_hf_config as tensors_of
from mxrl.formats.constants import Format
from mxrl.recipe import Backward, list_presets, resolve
from tests.arch.hf_configs import DEEPSEEK_V3_SMALL, QWEN2_MOE_A2_7B, QWEN3_30B_A3B

BF16, MXFP8, NVFP4, FP8_BLOCK = Format.BF16, Format.MXFP8, Format.NVFP4, Format.FP8_BLOCK
E = "model.layers.{}.mlp.experts.{}.{}_proj.weight"
ATTN = "model.layers.{}.self_attn.{}_proj.weight"


@cache
def qwen3_30b(layout: str = "per_expert"):
    return tuple(tensors_of(QWEN3_30B_A3B, layout))


@cache
def plan_30b(preset: str, layout: str = "per_expert"):
    return resolve(preset, qwen3_30b(layout))


def test_nvfp4_dequantized_on_qwen3_30b_a3b():
    plan = plan_30b("nvfp4-dequantized")
    assert plan.recipe_name == "nvfp4-dequantized" and plan.backward is Backward.DEQUANTIZED
    assert plan.num_layers == 48
    for expert in (0, 77, 127):
        gate, up, down = (plan[E.format(0, expert, r)] for r in ("gate", "up", "down"))
        for spec in (gate, up, down):
            assert spec.format is NVFP4 and spec.activations == "per_token"
            assert spec.kind is Kind.ROUTED_EXPERT and spec.layer == 0 and spec.expert == expert
            assert spec.rule == "rules[4] {kind: routed_expert}"
        assert gate.fuse_group == up.fuse_group == f"model.layers.0.mlp.experts.{expert}.gate_up"
        assert down.fuse_group is None
    assert plan[E.format(39, 5, "down")].format is NVFP4
    # last 15% of 48 layers = ceil(7.2) = 8 layers: 40..47, every tensor bf16
    for layer in range(40, 48):
        for name, spec in plan.items():
            if spec.layer == layer:
                assert spec.format is BF16, name
    assert plan[E.format(47, 0, "gate")].rule == "rules[0] {layers: last 15%}"
    # attention, router, embedding, lm_head stay bf16; norms are not matmul weights
    for layer in (0, 20, 47):
        for proj in "qkvo":
            assert plan[ATTN.format(layer, proj)].format is BF16
    assert plan["model.layers.0.mlp.gate.weight"].format is BF16
    assert plan["model.layers.0.mlp.gate.weight"].rule == "rules[2] {kind: router}"
    assert plan["model.embed_tokens.weight"].rule == "default"
    assert plan["lm_head.weight"].format is BF16
    assert plan["model.layers.0.input_layernorm.weight"].rule == "not a matmul weight"
    assert plan["model.norm.weight"].format is BF16
    quantized = {n for n, s in plan.items() if s.format is not BF16}
    assert len(quantized) == 40 * 128 * 3


def test_nvfp4_shared_experts_stay_bf16_on_qwen2_moe():
    plan = resolve("nvfp4-dequantized", tensors_of(QWEN2_MOE_A2_7B))
    m = "model.layers.0.mlp."
    for role in ("gate", "up", "down"):
        assert plan[f"{m}shared_expert.{role}_proj.weight"].format is BF16
        assert plan[f"{m}shared_expert.{role}_proj.weight"].rule == "rules[1] {kind: shared_expert}"
        assert plan[f"{m}experts.0.{role}_proj.weight"].format is NVFP4
    assert plan[f"{m}shared_expert_gate.weight"].format is BF16
    assert plan["model.layers.0.self_attn.q_proj.bias"].rule == "not a matmul weight"
    # 24 layers: last 15% = ceil(3.6) = 4 layers
    assert plan[E.format(19, 0, "up")].format is NVFP4
    assert plan[E.format(20, 0, "up")].format is BF16


@pytest.mark.parametrize("preset", ["mxfp8", "mxfp8-hp", "mxfp8-dequantized"])
def test_mxfp8_presets_on_qwen3_30b_a3b(preset):
    plan = plan_30b(preset)
    for layer in (0, 39):
        for proj in "qkvo":
            spec = plan[ATTN.format(layer, proj)]
            assert spec.format is MXFP8 and spec.activations is None and spec.fuse_group is None
        assert plan[E.format(layer, 3, "gate")].format is MXFP8
        assert plan[E.format(layer, 3, "down")].format is MXFP8
        assert plan[f"model.layers.{layer}.mlp.gate.weight"].format is BF16
    for proj in "qkvo":
        assert plan[ATTN.format(40, proj)].format is BF16
    assert plan["model.embed_tokens.weight"].format is BF16
    assert plan["lm_head.weight"].format is BF16


def test_backward_modes_do_not_change_the_contract():
    assert plan_30b("mxfp8").backward is Backward.QUANTIZED
    assert plan_30b("mxfp8-hp").backward is Backward.HIGH_PRECISION
    assert (
        plan_30b("mxfp8").hash()
        == plan_30b("mxfp8-hp").hash()
        == plan_30b("mxfp8-dequantized").hash()
    )
    assert plan_30b("nvfp4-hp").hash() == plan_30b("nvfp4-dequantized").hash()
    assert plan_30b("nvfp4-hp").hash() != plan_30b("mxfp8").hash()


def test_fp8_block_on_qwen3_30b_a3b():
    plan = plan_30b("fp8-block")
    q = plan[ATTN.format(0, "q")]
    assert q.format is FP8_BLOCK and q.block == (128, 128) and q.activations is None
    assert plan[E.format(0, 0, "down")].block == (128, 128)  # K = 768 = 6 * 128
    assert (
        plan[E.format(45, 0, "down")].format is BF16 and plan[E.format(45, 0, "down")].block is None
    )
    assert plan["model.layers.0.mlp.gate.weight"].format is BF16


def test_bf16_preset():
    plan = plan_30b("bf16")
    assert {s.format for s in plan.values()} == {BF16}


def test_every_preset_on_qwen3_30b_a3b():
    for preset in list_presets():
        plan = plan_30b(preset)
        assert len(plan) == len(qwen3_30b())
        assert all(s.format is BF16 for s in plan.values() if s.layer is not None and s.layer >= 40)


def test_deepseek_v3_mla_stays_bf16():
    tensors = tensors_of(DEEPSEEK_V3_SMALL)
    for preset in list_presets():
        plan = resolve(preset, tensors)
        for name, spec in plan.items():
            if spec.kind in (Kind.MLA, Kind.SHARED_EXPERT, Kind.ROUTER):
                assert spec.format is BF16, (preset, name)
        assert plan["model.layers.0.self_attn.o_proj.weight"].kind is Kind.MLA
        bias = plan["model.layers.3.mlp.gate.e_score_correction_bias"]
        assert bias.format is BF16 and bias.rule == "not a matmul weight"
    nvfp4 = resolve("nvfp4-hp", tensors)
    assert nvfp4[E.format(3, 0, "gate")].format is NVFP4
    assert nvfp4[E.format(4, 0, "gate")].format is BF16  # last 15% of 5 layers = 1 layer
    assert nvfp4["model.layers.0.mlp.gate_proj.weight"].format is BF16  # dense: not routed
    mxfp8 = resolve("mxfp8", tensors)
    assert mxfp8["model.layers.0.mlp.gate_proj.weight"].format is MXFP8  # dense_mlp


@pytest.mark.parametrize("preset", list_presets())
def test_both_expert_layouts_give_the_same_formats(preset):
    per_expert, fused = plan_30b(preset, "per_expert"), plan_30b(preset, "fused")
    assert per_expert.num_layers == fused.num_layers
    for layer in range(48):
        f = "model.layers.{}.mlp.experts.{}_proj"
        gate_up, down = fused[f.format(layer, "gate_up")], fused[f.format(layer, "down")]
        for expert in (0, 127):
            gate, up, d = (per_expert[E.format(layer, expert, r)] for r in ("gate", "up", "down"))
            for ours, theirs in ((gate, gate_up), (up, gate_up), (d, down)):
                assert (ours.format, ours.activations, ours.block) == (
                    theirs.format,
                    theirs.activations,
                    theirs.block,
                )
                assert (ours.fuse_group is None) == (theirs.fuse_group is None)
        if gate_up.fuse_group is not None:
            assert gate_up.fuse_group == gate_up.name
    others = {n: s for n, s in per_expert.items() if s.expert is None}
    assert all(fused[n].format is s.format for n, s in others.items())


def test_first_match_wins_and_name_globs():
    recipe = {
        "name": "t",
        "rules": [
            {"match": {"name": ["*.q_proj.weight", "*.k_proj.weight"]}, "format": "bf16"},
            {"match": {"kind": "attention"}, "format": "mxfp8"},
            {"match": {"kind": "attention"}, "format": "nvfp4"},
        ],
    }
    plan = resolve(recipe, tensors_of(builtin_config()))
    assert plan[ATTN.format(0, "q")].format is BF16
    assert plan[ATTN.format(0, "k")].format is BF16
    assert plan[ATTN.format(0, "v")].format is MXFP8
    assert plan[ATTN.format(0, "v")].rule == "rules[1] {kind: attention}"


def test_layer_selectors_skip_tensors_without_a_layer_and_1d_tensors():
    recipe = {
        "name": "t",
        "rules": [{"match": {"layers": "0-100"}, "format": "mxfp8"}],
        "default": "nvfp4",
    }
    plan = resolve(recipe, tensors_of(builtin_config()))
    assert plan["model.embed_tokens.weight"].format is NVFP4  # no layer: the default
    assert plan["model.embed_tokens.weight"].activations == "per_token"
    assert plan["model.embed_tokens.weight"].rule == "default"
    assert plan["model.embed_tokens.weight"].fuse_group is None
    assert plan["model.layers.0.mlp.gate.weight"].format is MXFP8
    assert plan["model.layers.0.input_layernorm.weight"].format is BF16
    assert plan["model.norm.weight"].rule == "not a matmul weight"


def test_num_layers_argument():
    tensors = tensors_of(builtin_config())
    plan = resolve("nvfp4-hp", tensors, num_layers=40)  # e.g. a pipeline stage of a deeper model
    assert plan.num_layers == 40
    assert plan[E.format(3, 0, "up")].format is NVFP4  # last 6 of 40 are 34..39
    with pytest.raises(ValueError, match=r"num_layers=3.*layer 3"):
        resolve("nvfp4-hp", tensors, num_layers=3)


def test_shape_error_names_tensor_shape_rule_and_fix():
    cfg = {**QWEN3_30B_A3B, "num_hidden_layers": 2, "num_experts": 4, "moe_intermediate_size": 48}
    with pytest.raises(ValueError) as err:
        resolve("mxfp8-hp", tensors_of(cfg))
    msg = str(err.value)
    assert "'model.layers.0.mlp.experts.0.down_proj.weight'" in msg
    assert "(2048, 48)" in msg
    assert "rules[4] {kind: [attention, dense_mlp, routed_expert]}" in msg
    assert "32" in msg and "format: bf16" in msg
    # nvfp4 blocks are 16 wide: 48 fits
    resolve("nvfp4-hp", tensors_of(cfg))
    with pytest.raises(ValueError, match=r"self_attn.q_proj.weight' of shape \(64, 64\).*128"):
        resolve("fp8-block", tensors_of(builtin_config()))


def test_the_suggested_fix_works():
    cfg = {**QWEN3_30B_A3B, "num_hidden_layers": 2, "num_experts": 4, "moe_intermediate_size": 48}
    recipe = {
        "name": "fixed",
        "rules": [
            {"match": {"name": "*.down_proj.weight", "kind": "routed_expert"}, "format": "bf16"},
            {"match": {"kind": "routed_expert"}, "format": "mxfp8"},
        ],
    }
    plan = resolve(recipe, tensors_of(cfg))
    assert plan[E.format(0, 0, "down")].format is BF16
    assert plan[E.format(0, 0, "up")].format is MXFP8


def test_fuse_mismatch_is_an_error():
    recipe = {
        "name": "split-pair",
        "rules": [
            {"match": {"name": "*.experts.*.up_proj.weight"}, "format": "bf16"},
            {"match": {"kind": "routed_expert"}, "format": "nvfp4", "fuse": ["gate", "up"]},
        ],
    }
    with pytest.raises(ValueError) as err:
        resolve(recipe, tensors_of(builtin_config()))
    msg = str(err.value)
    assert "fuse" in msg
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in msg
    assert "model.layers.0.mlp.experts.0.up_proj.weight" in msg
    assert "rules[0]" in msg and "rules[1]" in msg
    # same format, but only one half fused
    recipe["rules"][0] = {"match": {"name": "*.up_proj.weight"}, "format": "nvfp4"}
    with pytest.raises(ValueError, match="not fused"):
        resolve(recipe, tensors_of(builtin_config()))
    # per_tensor vs per_token activations
    recipe["rules"][0] = {
        "match": {"name": "*.up_proj.weight", "kind": "routed_expert"},
        "format": "nvfp4",
        "activations": "per_tensor",
        "fuse": ["gate", "up"],
    }
    with pytest.raises(ValueError, match="per_tensor"):
        resolve(recipe, tensors_of(builtin_config()))


def test_fuse_needs_both_halves():
    tensors = [(E.format(0, 0, "gate"), (32, 64)), (E.format(0, 0, "down"), (64, 32))]
    with pytest.raises(ValueError, match=r"up_proj.weight' is not among the tensors"):
        resolve("nvfp4-hp", tensors, num_layers=48)


def test_tensors_as_a_mapping():
    tensors = tensors_of(builtin_config())
    assert resolve("mxfp8", dict(tensors)) == resolve("mxfp8", tensors)


def test_bad_tensor_lists():
    with pytest.raises(ValueError, match="listed twice"):
        resolve("bf16", [("lm_head.weight", (4, 4)), ("lm_head.weight", (4, 4))])
    with pytest.raises(ValueError, match=r"unrecognised tensor name 'encoder.weight'"):
        resolve("bf16", [("encoder.weight", (4, 4))])
