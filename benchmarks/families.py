"""The model slices the benchmarks build, by family (`--family`): their layer shapes, the one
config builder, parameter counts, and the K/V bytes a decode step reads.

- `qwen3-moe` (the default of every script): Qwen3-30B-A3B's layer (QWEN3_30B_A3B_LAYER).
- `deepseek-v3`: Moonlight-16B-A3B's layer (MOONLIGHT_16B_A3B_LAYER; moonshotai's release is
  DeepSeek-V3's architecture, `DeepseekV3ForCausalLM`): hidden 2048, 16 heads, MLA with no q LoRA
  (`q_lora_rank` null), `kv_lora_rank` 512, per-head key 128 (no RoPE) + 64 (RoPE), value 128;
  64 routed experts (top-6) of intermediate 1408, 2 shared experts (one SwiGLU of 2816), a dense
  first layer of intermediate 11264 (`first_k_dense_replace` 1), sigmoid router with one group
  (`n_group` = `topk_group` = 1, `noaux_tc`), normalized top-k weights scaled by 2.446, RoPE
  theta 50000 without scaling, 8192 positions, RMSNorm eps 1e-5. Values from the published
  config.json as the issue quotes them (tests/test_benchmarks_families.py holds them as a table);
  keys it leaves to transformers' `DeepseekV3Config` defaults (`rope_interleave` true,
  `attention_bias` false) are left out here too, so `mxrl.arch.deepseek_v3.HF_DEFAULTS` supplies
  them as transformers does. The depth (`--layers`, the first one dense as in Moonlight) and the
  vocabulary (`--vocab`; Moonlight's is 163840) are the benchmark's.
"""

from __future__ import annotations

from typing import Any

import torch
from common import ensure_repo_on_path

ensure_repo_on_path()

from mxrl.arch import ModelConfig  # noqa: E402
from mxrl.engine.kv_cache import KVCache, cache_dims  # noqa: E402

FAMILIES = ("qwen3-moe", "deepseek-v3")
QWEN3_30B_A3B_LAYER = {  # Qwen3-30B-A3B's config.json, less the depth and the vocabulary
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
}
TINY_LAYER = {  # --tiny: exercises the script's logic on a CPU in seconds
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "rope_theta": 10_000.0,
    "rms_norm_eps": 1e-6,
}
MOONLIGHT_16B_A3B_LAYER = {  # Moonlight-16B-A3B's config.json, less the depth and the vocabulary
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "moe_intermediate_size": 1408,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.446,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "rope_theta": 50_000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
}
# --tiny DeepSeek layer: Moonlight's switches, small; hidden and the MLP widths multiples of 128
# so that the block-FP8 presets apply (the MLA projections stay bf16 in every preset)
TINY_DEEPSEEK_LAYER = {
    **MOONLIGHT_16B_A3B_LAYER,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 2,
    "moe_intermediate_size": 128,
    "rope_theta": 10_000.0,
    "max_position_embeddings": 4096,
}
_QWEN_KEYS = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
_DEEPSEEK_KEYS = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}


def family_layer(family: str, tiny: bool, tiny_layer: dict | None = None) -> dict[str, Any]:
    """The config.json keys of one layer of `family` (`tiny_layer` replaces the family's tiny
    default with `tiny`; a script's own tiny shapes)."""
    if family == "deepseek-v3":
        return dict((tiny_layer or TINY_DEEPSEEK_LAYER) if tiny else MOONLIGHT_16B_A3B_LAYER)
    if family == "qwen3-moe":
        return dict((tiny_layer or TINY_LAYER) if tiny else QWEN3_30B_A3B_LAYER)
    raise ValueError(f"family {family!r}: expected one of {', '.join(FAMILIES)}")


def model_config(
    *,
    layers: int,
    vocab: int,
    tiny: bool,
    tiny_layer: dict | None = None,
    family: str = "qwen3-moe",
    min_positions: int = 0,
) -> ModelConfig:
    """The benchmarks' config: `family`'s layer (Qwen3-30B-A3B's or Moonlight-16B-A3B's), or its
    tiny layer with `tiny`, at `layers` depth and a `vocab`-token vocabulary, untied embeddings;
    `max_position_embeddings` raised to `min_positions` where it is below (Qwen3-30B-A3B itself
    takes 40,960 positions; the slice's config says 4096)."""
    keys = _DEEPSEEK_KEYS if family == "deepseek-v3" else _QWEN_KEYS
    hf = {
        **keys,
        **family_layer(family, tiny, tiny_layer),
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    hf["max_position_embeddings"] = max(hf["max_position_embeddings"], min_positions)
    return ModelConfig.from_hf(hf)


def is_routed_expert(name: str) -> bool:
    """A routed expert's tensor (`...mlp.experts.*`), not a shared expert's nor the router's."""
    return ".mlp.experts." in name


def param_counts(model: torch.nn.Module) -> dict[str, int]:
    """Parameters of the slice, and those one token uses: every tensor but the routed experts
    whole (the embedding table included, as published "A3B" counts are), plus top-k / experts
    of each MoE layer's routed experts."""
    c = model.config
    total = routed = 0
    for name, p in model.named_parameters():
        total += p.numel()
        routed += p.numel() if is_routed_expert(name) else 0
    active = total - routed + round(routed * c.num_experts_per_tok / max(c.num_experts, 1))
    return {"num_params": total, "active_params_per_token": active}


def describe(config: ModelConfig, family: str) -> str:
    """One line naming the slice's shapes (printed at the start of a run)."""
    c = config
    head = f"{family}, {c.num_hidden_layers} layers, hidden {c.hidden_size}"
    if c.is_mla:
        dense = c.num_hidden_layers - len(c.moe_layers)
        head += (
            f", MLA {c.num_attention_heads} heads (kv_lora {c.kv_lora_rank}, k "
            f"{c.qk_nope_head_dim}+{c.head_dim}, v {c.v_head_dim}), {dense} dense layer(s)"
        )
    return f"{head}, {c.num_experts} experts top-{c.num_experts_per_tok}, vocab {c.vocab_size}"


def kv_token_bytes(config: ModelConfig, kv: KVCache | None, dtype: torch.dtype) -> int:
    """Bytes of one token's K/V in one layer as the engine caches it (`cache_dims`: for MLA the
    expanded per-head keys and values, not the latent), in the cache's dtype (fp8: codes and
    scales)."""
    heads, k_dim, v_dim = cache_dims(config)
    fp8 = bool(kv is not None and kv.fp8)
    return KVCache.bytes_per_block(1, 1, heads, k_dim, dtype, v_dim, fp8=fp8)


def latent_token_bytes(config: ModelConfig, dtype: torch.dtype) -> int | None:
    """Bytes of one token's MLA latent cache entry in one layer (kv_lora_rank + the shared RoPE
    key, DeepSeek's own cache): what a latent cache would read; None for a non-MLA model."""
    if not config.is_mla:
        return None
    return (config.kv_lora_rank + config.head_dim) * torch.empty((), dtype=dtype).element_size()


def step_kv_tokens(prompt_len: int, batch: int, steps: int) -> float:
    """Mean cached tokens one decode step's attention reads per layer: decode step s + 1 of a
    request attends to its prompt and the s + 1 tokens fed so far, its own included."""
    if steps < 1:
        return 0.0
    return batch * sum(prompt_len + s + 1 for s in range(steps)) / steps


def step_kv_bytes(engine, batch: int, prompt_len: int, steps: int) -> dict:
    """Mean K/V bytes one decode step's attention reads, every layer: as the engine caches them
    (`kv_bytes`; MLA: the expanded per-head keys and values of `engine.kv_cache.cache_dims`,
    not the latent), and as a latent cache would (`kv_latent_bytes`, MLA only, else None)."""
    c, tokens = engine.config, step_kv_tokens(prompt_len, batch, steps)
    kv = engine._kv  # allocated by the first generate (its dtype and fp8 flag)
    dtype = kv.dtype if kv is not None else torch.bfloat16
    latent = latent_token_bytes(c, dtype)
    per_token = c.num_hidden_layers * tokens
    return {
        "kv_bytes": per_token * kv_token_bytes(c, kv, dtype),
        "kv_latent_bytes": None if latent is None else per_token * latent,
    }


def add_floor_ms(row: dict, copy_gbps: float) -> None:
    """The step's byte floors as times at the copy bandwidth measured in this run."""
    for key in ("floor", "floor_latent"):
        nbytes = row.get(f"step_{key}_bytes")
        row[f"{key}_ms"] = None if nbytes is None else nbytes / (copy_gbps * 1e9) * 1e3
