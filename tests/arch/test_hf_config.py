"""Tensor names and shapes from HF config.json files, for every supported model type."""

from __future__ import annotations

import json

import pytest

from mxrl.arch import builtin_config, classify_tensors, tensors_from_hf_config
from tests.arch.hf_configs import DEEPSEEK_V3_SMALL, QWEN2_MOE_A2_7B, QWEN3_0_6B, QWEN3_30B_A3B


def _shapes(config, layout="per_expert"):
    return dict(tensors_from_hf_config(config, expert_layout=layout))


def test_qwen3_30b_a3b_per_expert():
    s = _shapes(QWEN3_30B_A3B)
    assert s["model.embed_tokens.weight"] == (151936, 2048)
    assert s["lm_head.weight"] == (151936, 2048)
    assert s["model.norm.weight"] == (2048,)
    a = "model.layers.0.self_attn."
    assert s[a + "q_proj.weight"] == (32 * 128, 2048)
    assert s[a + "k_proj.weight"] == (4 * 128, 2048)
    assert s[a + "v_proj.weight"] == (4 * 128, 2048)
    assert s[a + "o_proj.weight"] == (2048, 32 * 128)
    assert s[a + "q_norm.weight"] == (128,)
    assert a + "q_proj.bias" not in s
    assert s["model.layers.47.mlp.gate.weight"] == (128, 2048)
    assert s["model.layers.47.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert s["model.layers.47.mlp.experts.127.up_proj.weight"] == (768, 2048)
    assert s["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert "model.layers.48.mlp.gate.weight" not in s
    assert not any("shared_expert" in n for n in s)
    # 48 layers x (4 attn + 2 qk-norm + 2 norms + router + 128*3 experts) + embed, norm, lm_head
    assert len(s) == 48 * (8 + 1 + 384) + 3
    params = sum(_numel(shape) for shape in s.values())
    assert 30.4e9 < params < 30.6e9  # "30B"


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_qwen3_30b_a3b_fused_layout_matches_transformers_5():
    s = _shapes(QWEN3_30B_A3B, "fused")
    # transformers 5.23 Qwen3MoeExperts: gate_up_proj [E, 2*I, H] (gate rows first), down [E, H, I]
    assert s["model.layers.0.mlp.experts.gate_up_proj"] == (128, 2 * 768, 2048)
    assert s["model.layers.0.mlp.experts.down_proj"] == (128, 2048, 768)
    assert not any(".experts.0." in n for n in s)
    per_expert = _shapes(QWEN3_30B_A3B)
    assert sum(map(_numel, s.values())) == sum(map(_numel, per_expert.values()))


def test_qwen3_dense_tied():
    s = _shapes(QWEN3_0_6B)
    assert "lm_head.weight" not in s
    assert s["model.layers.27.mlp.gate_proj.weight"] == (3072, 1024)
    assert s["model.layers.27.mlp.down_proj.weight"] == (1024, 3072)
    assert s["model.layers.0.self_attn.q_proj.weight"] == (16 * 128, 1024)
    assert not any("experts" in n or "mlp.gate.weight" in n for n in s)


def test_qwen2_moe_shared_expert_and_biases():
    s = _shapes(QWEN2_MOE_A2_7B)
    m = "model.layers.3.mlp."
    assert s[m + "shared_expert.gate_proj.weight"] == (5632, 2048)
    assert s[m + "shared_expert.down_proj.weight"] == (2048, 5632)
    assert s[m + "shared_expert_gate.weight"] == (1, 2048)
    assert s[m + "experts.59.up_proj.weight"] == (1408, 2048)
    a = "model.layers.3.self_attn."
    assert s[a + "q_proj.bias"] == (2048,)
    assert s[a + "k_proj.bias"] == (2048,)
    assert a + "o_proj.bias" not in s
    assert a + "q_norm.weight" not in s  # qwen2 has no qk-norm


def test_deepseek_v3_mla_dense_layers_and_router_bias():
    s = _shapes(DEEPSEEK_V3_SMALL)
    a = "model.layers.0.self_attn."
    assert s[a + "q_a_proj.weight"] == (1536, 7168)
    assert s[a + "q_a_layernorm.weight"] == (1536,)
    assert s[a + "q_b_proj.weight"] == (128 * 192, 1536)
    assert s[a + "kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)
    assert s[a + "kv_a_layernorm.weight"] == (512,)
    assert s[a + "kv_b_proj.weight"] == (128 * 256, 512)
    assert s[a + "o_proj.weight"] == (7168, 128 * 128)
    assert s["model.layers.2.mlp.gate_proj.weight"] == (18432, 7168)  # dense < first_k_dense
    assert "model.layers.2.mlp.gate.weight" not in s
    assert s["model.layers.3.mlp.gate.weight"] == (8, 7168)
    assert s["model.layers.3.mlp.gate.e_score_correction_bias"] == (8,)
    assert s["model.layers.3.mlp.experts.7.down_proj.weight"] == (7168, 2048)
    assert s["model.layers.3.mlp.shared_experts.gate_proj.weight"] == (2048, 7168)
    fused = _shapes(DEEPSEEK_V3_SMALL, "fused")
    assert fused["model.layers.4.mlp.experts.gate_up_proj"] == (8, 4096, 7168)


def test_deepseek_without_q_lora_has_q_proj_classified_mla():
    s = _shapes({**DEEPSEEK_V3_SMALL, "q_lora_rank": None})
    assert s["model.layers.0.self_attn.q_proj.weight"] == (128 * 192, 7168)
    assert "model.layers.0.self_attn.q_a_proj.weight" not in s
    assert classify_tensors(s)["model.layers.0.self_attn.q_proj.weight"].kind == "mla"


def test_qwen3_moe_dense_layers():
    cfg = {
        **QWEN3_30B_A3B,
        "num_hidden_layers": 4,
        "mlp_only_layers": [0],
        "decoder_sparse_step": 2,
    }
    s = _shapes(cfg)
    infos = classify_tensors(s)
    assert s["model.layers.0.mlp.gate_proj.weight"] == (6144, 2048)
    assert infos["model.layers.0.mlp.gate_proj.weight"].kind == "dense_mlp"
    assert "model.layers.1.mlp.gate.weight" in s  # (1 + 1) % 2 == 0
    assert infos["model.layers.2.mlp.up_proj.weight"].kind == "dense_mlp"
    assert "model.layers.3.mlp.experts.0.up_proj.weight" in s


def test_every_generated_name_classifies():
    for cfg in (QWEN3_30B_A3B, QWEN3_0_6B, QWEN2_MOE_A2_7B, DEEPSEEK_V3_SMALL, builtin_config()):
        for layout in ("per_expert", "fused"):
            classify_tensors(n for n, _ in tensors_from_hf_config(cfg, layout))


def test_builtin_tiny_moe():
    cfg = builtin_config()
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_hidden_layers"] == 4
    s = _shapes(cfg)
    assert s["model.layers.0.mlp.experts.7.gate_proj.weight"] == (32, 64)
    assert s["model.layers.3.mlp.shared_expert.up_proj.weight"] == (64, 64)
    assert s["model.layers.3.mlp.shared_expert_gate.weight"] == (1, 64)
    assert s["model.layers.0.self_attn.k_proj.weight"] == (2 * 16, 64)
    assert s["lm_head.weight"] == (64, 64)


def test_config_from_file_and_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B))
    assert tensors_from_hf_config(tmp_path) == tensors_from_hf_config(QWEN3_0_6B)
    assert tensors_from_hf_config(str(tmp_path / "config.json")) == tensors_from_hf_config(
        QWEN3_0_6B
    )


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match=r"'llama'.*qwen3, qwen3_moe, qwen2_moe, deepseek_v3"):
        tensors_from_hf_config({**QWEN3_0_6B, "model_type": "llama"})
    with pytest.raises(ValueError, match="hidden_size"):
        tensors_from_hf_config({k: v for k, v in QWEN3_0_6B.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="expert_layout"):
        tensors_from_hf_config(QWEN3_0_6B, expert_layout="stacked")
    with pytest.raises(ValueError, match="not found"):
        tensors_from_hf_config(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        tensors_from_hf_config(tmp_path)
    with pytest.raises(ValueError, match="tiny-dense"):
        builtin_config("tiny-dense")


def test_transformers_5_spelling_num_local_experts():
    """transformers >= 5 writes `num_local_experts` where published configs say `num_experts`."""
    from mxrl.arch import builtin_config

    cfg = builtin_config("tiny-moe")
    renamed = {**{k: v for k, v in cfg.items() if k != "num_experts"}, "num_local_experts": 8}
    assert tensors_from_hf_config(renamed) == tensors_from_hf_config(cfg)
