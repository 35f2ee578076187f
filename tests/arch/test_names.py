"""Name classification for every supported family and both expert layouts."""

from __future__ import annotations

import pytest

from mxrl.arch import Kind, classify, classify_tensors, is_matmul_weight
from mxrl.arch.names import gate_up_group

L = "model.layers.7."


@pytest.mark.parametrize(
    ("name", "kind", "layer", "expert", "role"),
    [
        # whole-model tensors
        ("model.embed_tokens.weight", Kind.EMBEDDING, None, None, "embed"),
        ("lm_head.weight", Kind.LM_HEAD, None, None, "lm_head"),
        ("model.norm.weight", Kind.NORM, None, None, "final_norm"),
        # qwen3 dense
        (L + "input_layernorm.weight", Kind.NORM, 7, None, "input_norm"),
        (L + "post_attention_layernorm.weight", Kind.NORM, 7, None, "post_attention_norm"),
        (L + "self_attn.q_proj.weight", Kind.ATTENTION, 7, None, "q"),
        (L + "self_attn.k_proj.weight", Kind.ATTENTION, 7, None, "k"),
        (L + "self_attn.v_proj.weight", Kind.ATTENTION, 7, None, "v"),
        (L + "self_attn.o_proj.weight", Kind.ATTENTION, 7, None, "o"),
        (L + "self_attn.q_norm.weight", Kind.NORM, 7, None, "q_norm"),
        (L + "self_attn.k_norm.weight", Kind.NORM, 7, None, "k_norm"),
        (L + "mlp.gate_proj.weight", Kind.DENSE_MLP, 7, None, "gate"),
        (L + "mlp.up_proj.weight", Kind.DENSE_MLP, 7, None, "up"),
        (L + "mlp.down_proj.weight", Kind.DENSE_MLP, 7, None, "down"),
        # qwen3_moe, per-expert (published checkpoint) and fused (transformers 5)
        (L + "mlp.gate.weight", Kind.ROUTER, 7, None, "router"),
        (L + "mlp.experts.0.gate_proj.weight", Kind.ROUTED_EXPERT, 7, 0, "gate"),
        (L + "mlp.experts.127.up_proj.weight", Kind.ROUTED_EXPERT, 7, 127, "up"),
        (L + "mlp.experts.5.down_proj.weight", Kind.ROUTED_EXPERT, 7, 5, "down"),
        (L + "mlp.experts.gate_up_proj", Kind.ROUTED_EXPERT, 7, None, "gate_up"),
        (L + "mlp.experts.down_proj", Kind.ROUTED_EXPERT, 7, None, "down"),
        # qwen2_moe
        (L + "self_attn.q_proj.bias", Kind.ATTENTION, 7, None, "q"),
        (L + "mlp.shared_expert.gate_proj.weight", Kind.SHARED_EXPERT, 7, None, "gate"),
        (L + "mlp.shared_expert.up_proj.weight", Kind.SHARED_EXPERT, 7, None, "up"),
        (L + "mlp.shared_expert.down_proj.weight", Kind.SHARED_EXPERT, 7, None, "down"),
        (L + "mlp.shared_expert_gate.weight", Kind.ROUTER, 7, None, "shared_expert_gate"),
        # deepseek_v3
        (L + "self_attn.q_a_proj.weight", Kind.MLA, 7, None, "q_a"),
        (L + "self_attn.q_a_layernorm.weight", Kind.NORM, 7, None, "q_a_norm"),
        (L + "self_attn.q_b_proj.weight", Kind.MLA, 7, None, "q_b"),
        (L + "self_attn.kv_a_proj_with_mqa.weight", Kind.MLA, 7, None, "kv_a"),
        (L + "self_attn.kv_a_layernorm.weight", Kind.NORM, 7, None, "kv_a_norm"),
        (L + "self_attn.kv_b_proj.weight", Kind.MLA, 7, None, "kv_b"),
        (L + "mlp.gate.e_score_correction_bias", Kind.ROUTER, 7, None, "router_bias"),
        (L + "mlp.shared_experts.down_proj.weight", Kind.SHARED_EXPERT, 7, None, "down"),
    ],
)
def test_classify(name, kind, layer, expert, role):
    info = classify(name)
    assert info == (kind, layer, expert, role)
    kind_, layer_, expert_, role_ = info  # a plain tuple too
    assert (kind_, layer_, expert_, role_) == (kind, layer, expert, role)


def test_mla_o_proj_and_q_proj_need_the_layer_context():
    assert classify(L + "self_attn.o_proj.weight", mla_attention=True).kind is Kind.MLA
    assert classify(L + "self_attn.q_proj.weight", mla_attention=True).kind is Kind.MLA
    names = [
        "model.layers.0.self_attn.q_proj.weight",  # q_lora_rank: null
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",  # a standard-attention layer
    ]
    kinds = {n: i.kind for n, i in classify_tensors(names).items()}
    assert kinds[names[0]] is kinds[names[3]] is Kind.MLA
    assert kinds[names[4]] is Kind.ATTENTION


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.qkv_proj.weight",
        "transformer.h.0.attn.c_attn.weight",
        "model.layers.x.mlp.gate.weight",
        "model.layers.0.mlp.experts.gate_up_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
    ],
)
def test_unrecognised_names(name):
    with pytest.raises(ValueError) as err:
        classify(name)
    msg = str(err.value)
    assert name in msg and "qwen3_moe" in msg and "deepseek_v3" in msg


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        (L + "self_attn.q_proj.weight", (4096, 2048), True),
        ("model.embed_tokens.weight", (151936, 2048), True),
        (L + "mlp.experts.gate_up_proj", (128, 1536, 2048), True),
        (L + "mlp.experts.down_proj", (128, 2048, 768), True),
        (L + "mlp.shared_expert_gate.weight", (1, 2048), True),
        (L + "self_attn.q_proj.bias", (4096,), False),
        (L + "input_layernorm.weight", (2048,), False),
        (L + "mlp.gate.e_score_correction_bias", (256,), False),
    ],
)
def test_is_matmul_weight(name, shape, expected):
    assert is_matmul_weight(name, classify(name), shape) is expected


def test_gate_up_groups():
    def group(name):
        return gate_up_group(name, classify(name))

    assert group(L + "mlp.experts.3.gate_proj.weight") == "model.layers.7.mlp.experts.3.gate_up"
    assert group(L + "mlp.experts.3.up_proj.weight") == "model.layers.7.mlp.experts.3.gate_up"
    assert group(L + "mlp.experts.gate_up_proj") == L + "mlp.experts.gate_up_proj"
    assert group(L + "mlp.gate_proj.weight") == "model.layers.7.mlp.gate_up"
    assert group(L + "mlp.experts.3.down_proj.weight") is None
    assert group(L + "mlp.gate.weight") is None
