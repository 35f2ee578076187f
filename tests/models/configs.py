"""Tiny HF config dicts for the model tests: every family and switch mxrl.models supports."""

from __future__ import annotations

from typing import Any

_BASE: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
}
_MOE: dict[str, Any] = {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-tied": {**_BASE, "model_type": "qwen3", "tie_word_embeddings": True},
    "qwen3-untied-bias": {
        **_BASE,
        "model_type": "qwen3",
        "tie_word_embeddings": False,
        "attention_bias": True,
    },
    "qwen3_moe-norm-dense1": {
        **_BASE,
        **_MOE,
        "model_type": "qwen3_moe",
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "tie_word_embeddings": False,
    },
    "qwen3_moe-nonorm-tied": {
        **_BASE,
        **_MOE,
        "model_type": "qwen3_moe",
        "norm_topk_prob": False,
        "tie_word_embeddings": True,
    },
    "qwen2_moe-shared": {
        **_BASE,
        **_MOE,
        "model_type": "qwen2_moe",
        "num_hidden_layers": 3,
        "norm_topk_prob": False,
        "shared_expert_intermediate_size": 48,
        "qkv_bias": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "tie_word_embeddings": False,
    },
    "qwen2_moe-norm-step2": {
        **_BASE,
        **_MOE,
        "model_type": "qwen2_moe",
        "num_hidden_layers": 4,
        "norm_topk_prob": True,
        "shared_expert_intermediate_size": 48,
        "decoder_sparse_step": 2,
        "tie_word_embeddings": True,
    },
}
MOE_CONFIGS = [name for name, cfg in CONFIGS.items() if cfg["model_type"] != "qwen3"]
