"""Names and shapes from `tensors_from_hf_config(..., "fused")` against the state_dict of the
model transformers builds from the same config. Skipped where transformers is not installed
(it is not a dependency of mxrl; checked with transformers 5.23.0)."""

from __future__ import annotations

import pytest

from mxrl.arch import tensors_from_hf_config

transformers = pytest.importorskip("transformers", minversion="5.0")

_BASE = {
    "vocab_size": 64,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "tie_word_embeddings": False,
}
_MOE = {"moe_intermediate_size": 32, "num_experts_per_tok": 2}
_MLA = {
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
}
CONFIGS = {
    "qwen3": {"model_type": "qwen3", "attention_bias": True},
    "qwen3_moe": {"model_type": "qwen3_moe", **_MOE, "num_experts": 8, "mlp_only_layers": [1]},
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        **_MOE,
        "num_experts": 8,
        "shared_expert_intermediate_size": 48,
    },
    "deepseek_v3": {"model_type": "deepseek_v3", **_MOE, **_MLA, "q_lora_rank": 32},
    "deepseek_v3_no_q_lora": {
        "model_type": "deepseek_v3",
        **_MOE,
        **_MLA,
        "q_lora_rank": None,
        "attention_bias": True,
    },
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_fused_layout_matches_transformers_state_dict(family):
    cfg = {**_BASE, **CONFIGS[family]}
    hf_config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    theirs = sorted((k, tuple(v.shape)) for k, v in model.state_dict().items())
    assert theirs == sorted(tensors_from_hf_config(cfg, expert_layout="fused"))
