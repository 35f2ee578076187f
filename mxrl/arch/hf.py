"""Tensor names and shapes of a model from its HF `config.json` alone (no weights).

Shapes follow HF's linear convention, weight = [out_features, in_features], so the last dim is the
GEMM's reduction dim K that block formats scale along.

Expert layouts (`expert_layout`):
- "per_expert": `mlp.experts.{i}.{gate,up,down}_proj.weight`, [I, H], [I, H], [H, I] — the names
  of the published checkpoints (e.g. Qwen/Qwen3-30B-A3B) and of transformers < 5.
- "fused": what transformers 5.x (checked: 5.23.0) holds in `model.state_dict()`, built by the
  `MergeModulelist(dim=0), Concatenate(dim=1)` weight converter of `conversion_mapping.py`
  (the "qwen2_moe" entry, reused by qwen3_moe and deepseek_v3):
    `mlp.experts.gate_up_proj`: [E, 2*I, H] — rows 0..I-1 of each expert are gate_proj, rows
      I..2I-1 are up_proj (`linear(x, gate_up_proj[e]).chunk(2, dim=-1)` -> gate, up);
    `mlp.experts.down_proj`: [E, H, I].
  Both are bare nn.Parameters of the experts module (no `.weight` suffix), and K is still the
  last dim, so per-expert and fused layouts quantize along the same axis.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3")
EXPERT_LAYOUTS = ("per_expert", "fused")
BUILTIN_CONFIGS = ("tiny-moe",)

TensorList = list[tuple[str, tuple[int, ...]]]


def builtin_config(name: str = "tiny-moe") -> dict[str, Any]:
    """A built-in HF-style config.json (`mxrl/arch/configs/{name}.json`) as a dict."""
    if name not in BUILTIN_CONFIGS:
        raise ValueError(f"no built-in config {name!r}; built-in configs: {BUILTIN_CONFIGS}")
    text = (resources.files("mxrl.arch") / "configs" / f"{name}.json").read_text()
    return json.loads(text)


def load_hf_config(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """A config dict from a dict, a config.json path, or a directory holding config.json."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model config {str(path)!r} not found; pass a config.json or its folder")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model config {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model config {str(path)!r} must hold a JSON object")
    return data


# Keys transformers >= 5 writes under another name than the published config.json files.
_ALIASES = {"num_experts": "num_local_experts"}


def _get(cfg: Mapping[str, Any], key: str, default: Any = ...) -> Any:
    value = cfg.get(key, ...)
    if value is ... and key in _ALIASES:
        value = cfg.get(_ALIASES[key], ...)
    if value is ...:
        value = default
    if value is ...:
        raise ValueError(
            f"config.json of model_type {cfg.get('model_type')!r} lacks {key!r}; add it "
            "(copy it from the model's published config.json)"
        )
    return value


def tensors_from_hf_config(
    config: Mapping[str, Any] | str | Path, expert_layout: str = "per_expert"
) -> TensorList:
    """(canonical name, shape) of every tensor of the model, in HF state_dict order."""
    cfg = load_hf_config(config)
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout: {expert_layout!r} is not one of {EXPERT_LAYOUTS}")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    hidden = int(_get(cfg, "hidden_size"))
    vocab = int(_get(cfg, "vocab_size"))
    num_layers = int(_get(cfg, "num_hidden_layers"))
    out: TensorList = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        if model_type == "deepseek_v3":
            out += _mla(cfg, p, hidden)
        else:
            out += _attention(cfg, p, hidden, model_type)
        out += _mlp(cfg, p, hidden, layer, model_type, expert_layout)
        out += [(p + "input_layernorm.weight", (hidden,))]
        out += [(p + "post_attention_layernorm.weight", (hidden,))]
    out.append(("model.norm.weight", (hidden,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, hidden)))
    return out


def _attention(cfg: Mapping[str, Any], p: str, hidden: int, model_type: str) -> TensorList:
    heads = int(_get(cfg, "num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    a = p + "self_attn."
    out: TensorList = []
    if model_type == "qwen2_moe":
        qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
    else:
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
    for proj, rows in (("q", q), ("k", kv), ("v", kv)):
        out.append((f"{a}{proj}_proj.weight", (rows, hidden)))
        if qkv_bias:
            out.append((f"{a}{proj}_proj.bias", (rows,)))
    out.append((a + "o_proj.weight", (hidden, q)))
    if o_bias:
        out.append((a + "o_proj.bias", (hidden,)))
    if model_type in ("qwen3", "qwen3_moe"):
        out += [(a + "q_norm.weight", (head_dim,)), (a + "k_norm.weight", (head_dim,))]
    return out


def _mla(cfg: Mapping[str, Any], p: str, hidden: int) -> TensorList:
    heads = int(_get(cfg, "num_attention_heads"))
    q_lora = cfg.get("q_lora_rank")
    kv_lora = int(_get(cfg, "kv_lora_rank"))
    rope, nope = int(_get(cfg, "qk_rope_head_dim")), int(_get(cfg, "qk_nope_head_dim"))
    v_dim = int(_get(cfg, "v_head_dim"))
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


def _swiglu(prefix: str, hidden: int, inter: int) -> TensorList:
    return [
        (prefix + "gate_proj.weight", (inter, hidden)),
        (prefix + "up_proj.weight", (inter, hidden)),
        (prefix + "down_proj.weight", (hidden, inter)),
    ]


def _is_sparse(cfg: Mapping[str, Any], layer: int, model_type: str) -> bool:
    if model_type == "qwen3":
        return False
    if model_type == "deepseek_v3":
        return layer >= int(cfg.get("first_k_dense_replace") or 0)
    num_experts = int(_get(cfg, "num_experts"))
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_dense = cfg.get("mlp_only_layers") or []
    return layer not in only_dense and num_experts > 0 and (layer + 1) % step == 0


def _mlp(
    cfg: Mapping[str, Any], p: str, hidden: int, layer: int, model_type: str, layout: str
) -> TensorList:
    m = p + "mlp."
    if not _is_sparse(cfg, layer, model_type):
        return _swiglu(m, hidden, int(_get(cfg, "intermediate_size")))
    key = "n_routed_experts" if model_type == "deepseek_v3" else "num_experts"
    num_experts = int(_get(cfg, key))
    inter = int(_get(cfg, "moe_intermediate_size"))
    out: TensorList = [(m + "gate.weight", (num_experts, hidden))]
    if model_type == "deepseek_v3":
        out.append((m + "gate.e_score_correction_bias", (num_experts,)))
    if layout == "fused":
        out.append((m + "experts.gate_up_proj", (num_experts, 2 * inter, hidden)))
        out.append((m + "experts.down_proj", (num_experts, hidden, inter)))
    else:
        for e in range(num_experts):
            out += _swiglu(f"{m}experts.{e}.", hidden, inter)
    if model_type == "deepseek_v3":
        shared = int(cfg.get("n_shared_experts") or 0)
        if shared:
            out += _swiglu(m + "shared_experts.", hidden, inter * shared)
    else:
        # Always there in qwen2_moe; a qwen3_moe config may add one (our built-in tiny model).
        if model_type == "qwen2_moe":
            shared_inter = int(_get(cfg, "shared_expert_intermediate_size"))
        else:
            shared_inter = int(cfg.get("shared_expert_intermediate_size") or 0)
        if shared_inter:
            out += _swiglu(m + "shared_expert.", hidden, shared_inter)
            out.append((m + "shared_expert_gate.weight", (1, hidden)))
    return out
