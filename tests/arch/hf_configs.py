"""Small, realistic HF config.json dicts for the recipe and CLI tests (values from the published
configs; depth and expert counts of the DeepSeek one reduced to keep the tests fast)."""

from __future__ import annotations

# Qwen/Qwen3-30B-A3B config.json (the model of the article's ablation).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "attention_bias": False,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "hidden_act": "silu",
}

# Qwen/Qwen3-0.6B (dense, tied embeddings).
QWEN3_0_6B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": False,
    "tie_word_embeddings": True,
}

# Qwen/Qwen1.5-MoE-A2.7B (qwen2_moe: one shared expert with a sigmoid gate, q/k/v biases).
QWEN2_MOE_A2_7B = {
    "model_type": "qwen2_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}

# deepseek-ai/DeepSeek-V3 dimensions, 5 layers (3 dense) and 8 routed experts instead of 61/256.
DEEPSEEK_V3_SMALL = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 5,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "attention_bias": False,
    "tie_word_embeddings": False,
}
