"""Tensor names and shapes of a model from its HF `config.json` alone (no weights): the
embedding, each layer's tensors as its family's file lists them (`Family.layer_tensors`, from the
builders below), the norms and the LM head.

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
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

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


def config_value(cfg: Mapping[str, Any], key: str, default: Any = ...) -> Any:
    """cfg[key] (or its transformers >= 5 alias); `default` when absent, else ValueError."""
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


def required(cfg: Mapping[str, Any], key: str, alias: str | None = None) -> Any:
    """cfg[key], or cfg[alias]; ValueError naming the key when both are absent or null."""
    if cfg.get(key) is not None:
        return cfg[key]
    if alias is not None and cfg.get(alias) is not None:
        return cfg[alias]
    raise ValueError(
        f"config.json of model_type {cfg.get('model_type')!r} lacks {key!r}; add it (copy it "
        "from the model's published config.json)"
    )


def tensors_from_hf_config(
    config: Mapping[str, Any] | str | Path, expert_layout: str = "per_expert"
) -> TensorList:
    """(canonical name, shape) of every tensor of the model, in HF state_dict order: the
    family's `tensors` (mxrl.arch.FAMILIES, by the config's model_type)."""
    from mxrl.arch import FAMILIES  # the registry imports the family files, which import this one

    cfg = load_hf_config(config)
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout: {expert_layout!r} is not one of {EXPERT_LAYOUTS}")
    model_type = cfg.get("model_type")
    families = {f.model_type: f for f in FAMILIES}
    if model_type not in families:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(families)}"
        )
    return families[model_type].tensors(cfg, expert_layout)


LayerTensors = Callable[[Mapping[str, Any], str, int, int, str], TensorList]


def decoder_tensors(cfg: Mapping[str, Any], expert_layout: str, layer: LayerTensors) -> TensorList:
    """A decoder's tensors: the embedding, per layer `layer(cfg, prefix, hidden, index,
    expert_layout)` (its attention and MLP) and the two norms, the final norm, the LM head."""
    hidden = int(config_value(cfg, "hidden_size"))
    vocab = int(config_value(cfg, "vocab_size"))
    num_layers = int(config_value(cfg, "num_hidden_layers"))
    out: TensorList = [("model.embed_tokens.weight", (vocab, hidden))]
    for index in range(num_layers):
        p = f"model.layers.{index}."
        out += layer(cfg, p, hidden, index, expert_layout)
        out += [(p + "input_layernorm.weight", (hidden,))]
        out += [(p + "post_attention_layernorm.weight", (hidden,))]
    out.append(("model.norm.weight", (hidden,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, hidden)))
    return out


def attention(
    cfg: Mapping[str, Any], p: str, hidden: int, *, qkv_bias: bool, o_bias: bool, qk_norm: bool
) -> TensorList:
    """Grouped-query attention's q/k/v/o projections (+ biases, + per-head q/k norms)."""
    heads = int(config_value(cfg, "num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    a = p + "self_attn."
    out: TensorList = []
    for proj, rows in (("q", q), ("k", kv), ("v", kv)):
        out.append((f"{a}{proj}_proj.weight", (rows, hidden)))
        if qkv_bias:
            out.append((f"{a}{proj}_proj.bias", (rows,)))
    out.append((a + "o_proj.weight", (hidden, q)))
    if o_bias:
        out.append((a + "o_proj.bias", (hidden,)))
    if qk_norm:
        out += [(a + "q_norm.weight", (head_dim,)), (a + "k_norm.weight", (head_dim,))]
    return out


def swiglu(prefix: str, hidden: int, inter: int) -> TensorList:
    """gate, up and down projections of one SwiGLU MLP under `prefix`."""
    return [
        (prefix + "gate_proj.weight", (inter, hidden)),
        (prefix + "up_proj.weight", (inter, hidden)),
        (prefix + "down_proj.weight", (hidden, inter)),
    ]


def routed_experts(m: str, num_experts: int, inter: int, hidden: int, layout: str) -> TensorList:
    """The routed experts under `m` (`...mlp.`): fused 3-D tensors or one SwiGLU per expert."""
    if layout == "fused":
        return [
            (m + "experts.gate_up_proj", (num_experts, 2 * inter, hidden)),
            (m + "experts.down_proj", (num_experts, hidden, inter)),
        ]
    out: TensorList = []
    for e in range(num_experts):
        out += swiglu(f"{m}experts.{e}.", hidden, inter)
    return out
