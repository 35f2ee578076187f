"""DeepSeek-V3, names and tensors only (`architecture=None`): recipes resolve against it, and
`mxrl.models` does not build it (MLA attention and its latent KV cache are not implemented
there). MLA projections (`q_proj` when `q_lora_rank` is null), dense layers before
`first_k_dense_replace`, a router with `e_score_correction_bias`, `n_shared_experts` fused into
one shared SwiGLU."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxrl.arch.family import Family
from mxrl.arch.hf import TensorList, config_value, routed_experts, swiglu
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


def _mla(cfg: Mapping[str, Any], p: str, hidden: int) -> TensorList:
    heads = int(config_value(cfg, "num_attention_heads"))
    q_lora = cfg.get("q_lora_rank")
    kv_lora = int(config_value(cfg, "kv_lora_rank"))
    rope, nope = (
        int(config_value(cfg, "qk_rope_head_dim")),
        int(config_value(cfg, "qk_nope_head_dim")),
    )
    v_dim = int(config_value(cfg, "v_head_dim"))
    bias = bool(cfg.get("attention_bias", False))
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
    if layer < int(cfg.get("first_k_dense_replace") or 0):
        return swiglu(m, hidden, int(config_value(cfg, "intermediate_size")))
    num_experts = int(config_value(cfg, "n_routed_experts"))
    inter = int(config_value(cfg, "moe_intermediate_size"))
    out: TensorList = [(m + "gate.weight", (num_experts, hidden))]
    out.append((m + "gate.e_score_correction_bias", (num_experts,)))
    out += routed_experts(m, num_experts, inter, hidden, layout)
    shared = int(cfg.get("n_shared_experts") or 0)
    if shared:
        out += swiglu(m + "shared_experts.", hidden, inter * shared)
    return out


def _layer(cfg: Mapping[str, Any], p: str, hidden: int, layer: int, layout: str) -> TensorList:
    return _mla(cfg, p, hidden) + _mlp(cfg, p, hidden, layer, layout)


DEEPSEEK_V3 = Family(
    model_type="deepseek_v3",
    architecture=None,
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
)
