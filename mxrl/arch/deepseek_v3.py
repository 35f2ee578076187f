"""DeepSeek-V3 (`DeepseekV3ForCausalLM`; also DeepSeek-R1, Kimi-K2, Moonlight): multi-head latent
attention (MLA: `q_a_proj`/`q_a_layernorm`/`q_b_proj`, or `q_proj` when `q_lora_rank` is null;
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`), dense layers before
`first_k_dense_replace`, a sigmoid router with `e_score_correction_bias` and group-limited top-k,
`n_shared_experts` fused into one shared SwiGLU (`mxrl.models.mla` builds it).

A key config.json omits takes transformers' `DeepseekV3Config` default (`HF_DEFAULTS`), as
transformers itself reads the file; a field whose other values mxrl does not implement
(`scoring_func`, `topk_method`, RoPE scaling other than YaRN, `moe_layer_freq`, ...) is refused
by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxrl.arch.family import Family
from mxrl.arch.hf import TensorList, config_value, required, routed_experts, swiglu
from mxrl.arch.names import (
    ATTENTION,
    DENSE_MLP,
    LAYER_NORMS,
    MLA,
    ROUTED_EXPERTS,
    ROUTER,
    ROUTER_BIAS,
    SHARED_EXPERTS,
)

# transformers 5.x `DeepseekV3Config` defaults of the switches (checked: 5.24): what a config.json
# that omits the key means to transformers, the oracle of mxrl.models' parity tests.
HF_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 1536,
    "first_k_dense_replace": 3,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rope_interleave": True,
    "attention_bias": False,
}
# Fields of the published configs (deepseek-ai/DeepSeek-V3 and V2's code) with the one value
# mxrl.models implements (transformers ignores them: a config with another value would be
# misread by both, so it is refused).
_ONLY = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def _switch(cfg: Mapping[str, Any], key: str) -> Any:
    """cfg[key] (null allowed only for q_lora_rank), or transformers' default when absent."""
    if key not in cfg:
        return HF_DEFAULTS[key]
    if cfg[key] is None and key != "q_lora_rank":
        raise ValueError(
            f"config.json of model_type 'deepseek_v3': {key} is null; set it (transformers' "
            f"default is {HF_DEFAULTS[key]!r})"
        )
    return cfg[key]


def _mla(cfg: Mapping[str, Any], p: str, hidden: int) -> TensorList:
    heads = int(config_value(cfg, "num_attention_heads"))
    q_lora = _switch(cfg, "q_lora_rank")
    kv_lora = int(config_value(cfg, "kv_lora_rank"))
    rope, nope = (
        int(config_value(cfg, "qk_rope_head_dim")),
        int(config_value(cfg, "qk_nope_head_dim")),
    )
    v_dim = int(config_value(cfg, "v_head_dim"))
    bias = bool(_switch(cfg, "attention_bias"))
    a = p + "self_attn."
    out: TensorList = []
    if q_lora is None:
        out.append((a + "q_proj.weight", (heads * (nope + rope), hidden)))
    else:
        out.append((a + "q_a_proj.weight", (int(q_lora), hidden)))
        if bias:
            out.append((a + "q_a_proj.bias", (int(q_lora),)))
        out.append((a + "q_a_layernorm.weight", (int(q_lora),)))
        out.append((a + "q_b_proj.weight", (heads * (nope + rope), int(q_lora))))
    out.append((a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden)))
    if bias:
        out.append((a + "kv_a_proj_with_mqa.bias", (kv_lora + rope,)))
    out.append((a + "kv_a_layernorm.weight", (kv_lora,)))
    out.append((a + "kv_b_proj.weight", (heads * (nope + v_dim), kv_lora)))
    out.append((a + "o_proj.weight", (hidden, heads * v_dim)))
    if bias:
        out.append((a + "o_proj.bias", (hidden,)))
    return out


def _mlp(cfg: Mapping[str, Any], p: str, hidden: int, layer: int, layout: str) -> TensorList:
    m = p + "mlp."
    if layer < int(_switch(cfg, "first_k_dense_replace")):
        return swiglu(m, hidden, int(config_value(cfg, "intermediate_size")))
    num_experts = int(config_value(cfg, "n_routed_experts"))
    inter = int(config_value(cfg, "moe_intermediate_size"))
    out: TensorList = [(m + "gate.weight", (num_experts, hidden))]
    out.append((m + "gate.e_score_correction_bias", (num_experts,)))
    out += routed_experts(m, num_experts, inter, hidden, layout)
    # transformers builds the shared SwiGLU for n_shared_experts 0 too, zero wide (its output 0)
    shared = int(_switch(cfg, "n_shared_experts"))
    return out + swiglu(m + "shared_experts.", hidden, inter * shared)


def _layer(cfg: Mapping[str, Any], p: str, hidden: int, layer: int, layout: str) -> TensorList:
    return _mla(cfg, p, hidden) + _mlp(cfg, p, hidden, layer, layout)


def _check_implemented(cfg: Mapping[str, Any]) -> None:
    for key, value in _ONLY.items():
        if key in cfg and cfg[key] != value:
            raise ValueError(
                f"config.json of model_type 'deepseek_v3': {key} {cfg[key]!r} is not supported; "
                f"mxrl.models implements {key} {value!r} only (DeepSeek-V3's)"
            )
    heads = int(required(cfg, "num_attention_heads"))
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != heads:
        raise ValueError(
            f"config.json of model_type 'deepseek_v3': num_key_value_heads {kv_heads} != "
            f"num_attention_heads {heads}; MLA expands its latent to one key and value per "
            "query head (set num_key_value_heads to num_attention_heads)"
        )


def _config_fields(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    _check_implemented(cfg)
    bias = bool(_switch(cfg, "attention_bias"))
    q_lora = _switch(cfg, "q_lora_rank")
    inter = int(required(cfg, "moe_intermediate_size"))
    first_moe = int(_switch(cfg, "first_k_dense_replace"))
    return {
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": False,
        "num_key_value_heads": int(required(cfg, "num_attention_heads")),
        # transformers' DeepseekV3Config: head_dim is the RoPE part (its rotary embedding's dim)
        "head_dim": int(required(cfg, "qk_rope_head_dim")),
        "q_lora_rank": 0 if q_lora is None else int(q_lora),
        "kv_lora_rank": int(required(cfg, "kv_lora_rank")),
        "qk_nope_head_dim": int(required(cfg, "qk_nope_head_dim")),
        "v_head_dim": int(required(cfg, "v_head_dim")),
        "rope_interleave": bool(_switch(cfg, "rope_interleave")),
        "moe_layers": tuple(range(max(first_moe, 0), num_layers)),
        "num_experts": int(required(cfg, "n_routed_experts", alias="num_local_experts")),
        "num_experts_per_tok": int(required(cfg, "num_experts_per_tok")),
        "moe_intermediate_size": inter,
        "norm_topk_prob": bool(_switch(cfg, "norm_topk_prob")),
        "shared_expert_intermediate_size": inter * int(_switch(cfg, "n_shared_experts")),
        "scoring_func": "sigmoid",
        "n_group": int(_switch(cfg, "n_group")),
        "topk_group": int(_switch(cfg, "topk_group")),
        "routed_scaling_factor": float(_switch(cfg, "routed_scaling_factor")),
    }


def _hf_fields(c: Any) -> dict[str, Any]:
    return {
        "attention_bias": c.qkv_bias,
        "q_lora_rank": c.q_lora_rank or None,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_rope_head_dim": c.head_dim,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "v_head_dim": c.v_head_dim,
        "rope_interleave": c.rope_interleave,
        "first_k_dense_replace": min(c.moe_layers, default=c.num_hidden_layers),
        "n_routed_experts": c.num_experts,
        "n_shared_experts": c.shared_expert_intermediate_size // c.moe_intermediate_size,
        "n_group": c.n_group,
        "topk_group": c.topk_group,
        "routed_scaling_factor": c.routed_scaling_factor,
        "scoring_func": c.scoring_func,
        "topk_method": "noaux_tc",
        "rope_scaling": {"type": "yarn", **dict(c.rope_scaling)} if c.rope_scaling else None,
    }


def _mtp_layers(cfg: Mapping[str, Any]) -> int:
    """The releases' multi-token-prediction layers (`model.layers.{num_hidden_layers}.*`),
    which transformers' DeepseekV3ForCausalLM does not build either and skips on load
    (`num_nextn_predict_layers`, alias `num_mtp_layers`; transformers' default 1)."""
    value = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 1))
    return int(value or 0)


DEEPSEEK_V3 = Family(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    # ATTENTION: `self_attn.q_proj` / `o_proj`, which classify_tensors makes MLA in an MLA layer
    pieces=(
        LAYER_NORMS,
        ATTENTION,
        MLA,
        DENSE_MLP,
        ROUTER,
        ROUTER_BIAS,
        ROUTED_EXPERTS,
        SHARED_EXPERTS,
    ),
    layer_tensors=_layer,
    config_fields=_config_fields,
    hf_fields=_hf_fields,
    rope_types=("default", "yarn"),
    unbuilt_layers=_mtp_layers,
)
