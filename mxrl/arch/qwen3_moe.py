"""Qwen3-MoE (`Qwen3MoeForCausalLM`): attention with per-head q/k norms, sparse MoE layers by
transformers' rule (`decoder_sparse_step`, `mlp_only_layers`), an optional shared expert (the
built-in tiny model has one). `moe_layer` and `moe_fields` are Qwen2-MoE's too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxrl.arch.family import Family
from mxrl.arch.hf import TensorList, attention, config_value, required, routed_experts, swiglu
from mxrl.arch.names import (
    ATTENTION,
    DENSE_MLP,
    LAYER_NORMS,
    QK_NORM,
    ROUTED_EXPERTS,
    ROUTER,
    SHARED_EXPERT,
)


def is_sparse(cfg: Mapping[str, Any], layer: int) -> bool:
    """transformers' Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer rule for a layer's MLP."""
    num_experts = int(config_value(cfg, "num_experts"))
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_dense = cfg.get("mlp_only_layers") or []
    return layer not in only_dense and num_experts > 0 and (layer + 1) % step == 0


def moe_layer(
    cfg: Mapping[str, Any], p: str, hidden: int, layer: int, layout: str, shared_required: bool
) -> TensorList:
    """A Qwen MoE layer's MLP: dense SwiGLU, or router, routed experts and, when the config
    sizes one, a shared expert with its sigmoid gate (`shared_required`: always, Qwen2-MoE)."""
    m = p + "mlp."
    if not is_sparse(cfg, layer):
        return swiglu(m, hidden, int(config_value(cfg, "intermediate_size")))
    num_experts = int(config_value(cfg, "num_experts"))
    inter = int(config_value(cfg, "moe_intermediate_size"))
    out: TensorList = [(m + "gate.weight", (num_experts, hidden))]
    out += routed_experts(m, num_experts, inter, hidden, layout)
    if shared_required:
        shared_inter = int(config_value(cfg, "shared_expert_intermediate_size"))
    else:  # a qwen3_moe config may add one (the built-in tiny model does)
        shared_inter = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared_inter:
        out += swiglu(m + "shared_expert.", hidden, shared_inter)
        out.append((m + "shared_expert_gate.weight", (1, hidden)))
    return out


def _layer(cfg: Mapping[str, Any], p: str, hidden: int, layer: int, layout: str) -> TensorList:
    bias = bool(cfg.get("attention_bias", False))
    out = attention(cfg, p, hidden, qkv_bias=bias, o_bias=bias, qk_norm=True)
    return out + moe_layer(cfg, p, hidden, layer, layout, shared_required=False)


def moe_fields(cfg: Mapping[str, Any], num_layers: int, shared_required: bool) -> dict[str, Any]:
    """ModelConfig's MoE keywords of a Qwen MoE config: `moe_layers` and, if any, the experts."""
    num_experts = int(required(cfg, "num_experts", alias="num_local_experts"))
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    # transformers' Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer rule.
    moe_layers = tuple(
        i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
    )
    kw: dict[str, Any] = {}
    if moe_layers:
        kw.update(
            num_experts=num_experts,
            num_experts_per_tok=int(required(cfg, "num_experts_per_tok")),
            moe_intermediate_size=int(required(cfg, "moe_intermediate_size")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )
        if shared_required:
            shared = int(required(cfg, "shared_expert_intermediate_size"))
        else:  # a qwen3_moe config may add one (the built-in tiny model does)
            shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        kw["shared_expert_intermediate_size"] = shared
    kw["moe_layers"] = moe_layers
    return kw


def dense_layers(config: Any) -> list[int]:
    """`mlp_only_layers` of a MoE ModelConfig: the layers whose MLP is dense."""
    return [i for i in range(config.num_hidden_layers) if i not in config.moe_layers]


def _config_fields(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, **moe_fields(cfg, num_layers, False)}


QWEN3_MOE = Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    pieces=(LAYER_NORMS, ATTENTION, QK_NORM, DENSE_MLP, ROUTER, ROUTED_EXPERTS, SHARED_EXPERT),
    layer_tensors=_layer,
    config_fields=_config_fields,
    hf_fields=lambda c: {"attention_bias": c.qkv_bias, "mlp_only_layers": dense_layers(c)},
)
