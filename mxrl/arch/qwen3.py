"""Qwen3 (`Qwen3ForCausalLM`), dense: attention with per-head q/k norms (q/k/v/o biases with
`attention_bias`) and a SwiGLU MLP in every layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxrl.arch.family import Family
from mxrl.arch.hf import TensorList, attention, config_value, swiglu
from mxrl.arch.names import ATTENTION, DENSE_MLP, LAYER_NORMS, QK_NORM


def _layer(cfg: Mapping[str, Any], p: str, hidden: int, layer: int, layout: str) -> TensorList:
    bias = bool(cfg.get("attention_bias", False))
    out = attention(cfg, p, hidden, qkv_bias=bias, o_bias=bias, qk_norm=True)
    return out + swiglu(p + "mlp.", hidden, int(config_value(cfg, "intermediate_size")))


def _config_fields(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


QWEN3 = Family(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    pieces=(LAYER_NORMS, ATTENTION, QK_NORM, DENSE_MLP),
    layer_tensors=_layer,
    config_fields=_config_fields,
    hf_fields=lambda c: {"attention_bias": c.qkv_bias},
)
