"""The tiny MoE and the recipes the served-export edge tests share (test_served_edges.py,
test_served_config.py)."""

import torch

from mxrl.arch import ModelConfig
from mxrl.models import build_model
from mxrl.recipe import resolve

# two layers, two experts, every dimension a multiple of 32 (fp8_block [32, 32] fits)
TINY_MOE = {
    "vocab_size": 64,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "intermediate_size": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 64,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "norm_topk_prob": True,
}
L0, L1 = "model.layers.0", "model.layers.1"
ATTN0 = [f"{L0}.self_attn.{p}_proj" for p in "kqvo"]
ATTN1 = [f"{L1}.self_attn.{p}_proj" for p in "kqvo"]


def experts(layer: str) -> list[str]:
    """The experts module and every per-expert Linear of a TINY_MOE layer."""
    parts = ("down_proj", "gate_proj", "up_proj")
    return [f"{layer}.mlp.experts"] + [
        f"{layer}.mlp.experts.{e}.{p}" for e in (0, 1) for p in parts
    ]


def model_and_plan(recipe, config=TINY_MOE):
    model = build_model(ModelConfig.from_hf(config), dtype=torch.float32, seed=0)
    return model, resolve(recipe, {n: p.shape for n, p in model.named_parameters()})


def recipe(*rules, name="edge") -> dict:
    return {"name": name, "default": "bf16", "rules": list(rules)}


FP8_L0 = recipe(
    {"match": {"kind": ["attention", "routed_expert"], "layers": "0"}, "format": "fp8_block",
     "block": [32, 32]},
)  # fmt: skip
MIXED_CT = recipe(
    {"match": {"kind": "attention"}, "format": "mxfp8"},
    {"match": {"kind": "routed_expert", "layers": "0"}, "format": "nvfp4",
     "activations": "per_tensor"},
    {"match": {"kind": "routed_expert", "layers": "1"}, "format": "nvfp4",
     "activations": "per_token"},
)  # fmt: skip
