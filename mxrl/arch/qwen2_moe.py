"""Qwen2-MoE (`Qwen2MoeForCausalLM`): q/k/v biases (`qkv_bias`, default true), no o bias and no
q/k norms; Qwen3-MoE's sparse-layer rule, with a shared expert and its gate in every MoE layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxrl.arch.family import Family
from mxrl.arch.hf import TensorList, attention
from mxrl.arch.names import ATTENTION, DENSE_MLP, LAYER_NORMS, ROUTED_EXPERTS, ROUTER, SHARED_EXPERT
from mxrl.arch.qwen3_moe import dense_layers, moe_fields, moe_layer


def _layer(cfg: Mapping[str, Any], p: str, hidden: int, layer: int, layout: str) -> TensorList:
    qkv_bias = bool(cfg.get("qkv_bias", True))
    out = attention(cfg, p, hidden, qkv_bias=qkv_bias, o_bias=False, qk_norm=False)
    return out + moe_layer(cfg, p, hidden, layer, layout, shared_required=True)


def _config_fields(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    qkv_bias = bool(cfg.get("qkv_bias", True))
    return {
        "qkv_bias": qkv_bias,
        "o_bias": False,
        "qk_norm": False,
        **moe_fields(cfg, num_layers, True),
    }


QWEN2_MOE = Family(
    model_type="qwen2_moe",
    architecture="Qwen2MoeForCausalLM",
    pieces=(LAYER_NORMS, ATTENTION, DENSE_MLP, ROUTER, ROUTED_EXPERTS, SHARED_EXPERT),
    layer_tensors=_layer,
    config_fields=_config_fields,
    hf_fields=lambda c: {"qkv_bias": c.qkv_bias, "mlp_only_layers": dense_layers(c)},
)
