"""transformers' DeepseekV3ForCausalLM as the oracle of mxrl.models' deepseek_v3 family: tiny
configs covering every switch, and the reference model with every parameter and the router's
e_score_correction_bias (a buffer transformers leaves at zero) drawn at random."""

from __future__ import annotations

from typing import Any

import torch

from tests.models.hf_reference import transformers

_BASE: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "q_lora_rank": 24,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 12,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rope_interleave": True,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "qlora-grouped-shared1": _BASE,
    "noqlora-bias-shared2-dense2": {
        **_BASE,
        "q_lora_rank": None,
        "attention_bias": True,
        "n_shared_experts": 2,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 2,
    },
    "shared0-nointerleave-nonorm-tied": {
        **_BASE,
        "n_shared_experts": 0,
        "rope_interleave": False,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": True,
    },
    "onegroup-nodense-k3": {
        **_BASE,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 3,
        "first_k_dense_replace": 0,
        "q_lora_rank": None,
    },
    # DeepSeek-V3's YaRN (legacy rope_scaling form, as the published config.json), mscale and
    # mscale_all_dim apart so that both the cos/sin factor and the softmax's mscale^2 differ from 1
    "yarn-mscale": {
        **_BASE,
        "max_position_embeddings": 512,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.9,
            "mscale_all_dim": 0.7,
        },
    },
    "groups8-top3-bias": {
        **_BASE,
        "n_routed_experts": 16,
        "n_group": 8,
        "topk_group": 3,
        "attention_bias": True,
    },
}


def hf_deepseek(cfg: dict[str, Any], seed: int = 0) -> Any:
    """transformers' model in fp32, sdpa attention and the eager experts loop (its default
    grouped_mm sums in another order), every parameter and e_score_correction_bias random."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", experts_implementation="eager", dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # the size of the score differences: it moves the selection
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model.eval()
