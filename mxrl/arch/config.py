"""ModelConfig: the architecture of a Qwen3 / Qwen3-MoE / Qwen2-MoE model, read from config.json.

One dataclass for the three families; the family only decides a few switches (q/k RMSNorm, which
projections carry a bias, which layers are MoE, whether they have a shared expert): its file's
`config_fields` and `hf_fields` (`mxrl.arch.qwen3`, `qwen3_moe`, `qwen2_moe`). The HF dict the config was
read from is kept verbatim in `hf_config`, so `save_pretrained` writes back what it was given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mxrl.arch.hf import load_hf_config, required

if TYPE_CHECKING:
    from mxrl.arch.family import Family
# transformers' default when neither rope_theta nor rope_parameters is given.
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture switches and sizes. Build it with `ModelConfig.from_hf(dict_or_path)`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int = 0  # dense SwiGLU MLP; 0 when every layer is MoE
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = True  # per-head RMSNorm on q and k before RoPE (qwen3, qwen3_moe)
    initializer_range: float = 0.02
    # MoE (num_experts = 0: dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # > 0: Qwen2-MoE shared expert + sigmoid gate
    moe_layers: tuple[int, ...] = ()  # decoder layers whose MLP is the sparse MoE block
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        built = _built_families()
        if self.model_type not in built:
            raise ValueError(
                f"model_type: {self.model_type!r} is not supported by mxrl.models; supported: "
                f"{', '.join(built)}"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            _positive(name, getattr(self, name))
        _positive("num_key_value_heads", self.num_key_value_heads)
        _positive("head_dim", self.head_dim)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: RoPE rotates pairs")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0 or self.initializer_range <= 0:
            raise ValueError("rms_norm_eps, rope_theta and initializer_range must be > 0")
        layers = tuple(sorted(set(self.moe_layers)))
        object.__setattr__(self, "moe_layers", layers)
        if any(not 0 <= i < self.num_hidden_layers for i in layers):
            raise ValueError(
                f"moe_layers {list(layers)} must lie in 0..{self.num_hidden_layers - 1}"
            )
        if len(layers) < self.num_hidden_layers:
            _positive("intermediate_size", self.intermediate_size, "(the dense MLP layers need it)")
        if layers:
            _positive("num_experts", self.num_experts, "(the model has MoE layers)")
            _positive("moe_intermediate_size", self.moe_intermediate_size)
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                    f"1..num_experts ({self.num_experts})"
                )
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("shared_expert_intermediate_size must be >= 0 (0: no shared expert)")

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def max_positions(self) -> int | None:
        """`max_position_embeddings` of the HF config: the positions the model was trained for,
        which a prompt and its completion must fit in (RoPE runs past them silently, on angles
        the model never saw); None when the config does not say."""
        value = self.hf_config.get("max_position_embeddings")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return None
        return value

    def check_positions(self, prompt_len: int, new_len: int, what: str, new_name: str) -> None:
        """ValueError when a sequence of prompt_len + new_len tokens runs past `max_positions`;
        `what` names the sequence ("request 3"), `new_name` its new tokens ("max_new_tokens")."""
        limit = self.max_positions
        if limit is None or prompt_len + new_len <= limit:
            return
        room = limit - prompt_len
        fix = (
            f"lower {new_name} to at most {room} or shorten the prompt"
            if room > 0
            else f"shorten the prompt to fewer than {limit} tokens"
        )
        raise ValueError(
            f"{what}: the prompt's {prompt_len} tokens + {new_name} {new_len} = "
            f"{prompt_len + new_len} tokens exceed the model's max_position_embeddings {limit} "
            f"(config.json); positions past it were never trained. {fix[0].upper()}{fix[1:]}"
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | Path) -> ModelConfig:
        """Read an HF config (dict, config.json, or its directory).

        Accepts what published checkpoints carry (`rope_theta`, `rope_scaling: null`,
        `num_experts`) and what transformers >= 5 writes (`rope_parameters`,
        `num_local_experts`). Raises ValueError naming a missing key or an unsupported feature.
        """
        cfg = load_hf_config(config)
        model_type = cfg.get("model_type")
        built = _built_families()
        if model_type not in built:
            raise ValueError(
                f"model_type: {model_type!r} is not supported by mxrl.models; supported: "
                f"{', '.join(built)} (set model_type in config.json)"
            )
        _check_unsupported(cfg)
        hidden = int(required(cfg, "hidden_size"))
        heads = int(required(cfg, "num_attention_heads"))
        num_layers = int(required(cfg, "num_hidden_layers"))
        kw: dict[str, Any] = {
            "model_type": model_type,
            "vocab_size": int(required(cfg, "vocab_size")),
            "hidden_size": hidden,
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": _head_dim(cfg, hidden, heads),
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "rope_theta": _rope_theta(cfg),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "initializer_range": float(cfg.get("initializer_range", 0.02)),
            "hf_config": dict(cfg),
        }
        kw.update(built[model_type].config_fields(cfg, num_layers))
        moe_layers = kw.setdefault("moe_layers", ())
        if len(moe_layers) < num_layers:
            kw["intermediate_size"] = int(required(cfg, "intermediate_size"))
        return cls(**kw)

    def to_hf(self, dtype: str | None = None) -> dict[str, Any]:
        """The HF config dict to write next to the weights (`dtype` sets torch_dtype/dtype)."""
        out = dict(self.hf_config) if self.hf_config else self._synthesize_hf()
        out.setdefault("architectures", [_built_families()[self.model_type].architecture])
        if dtype is not None:
            # transformers < 5 reads torch_dtype, >= 5 writes and reads dtype.
            out["torch_dtype"] = out["dtype"] = dtype
        return out

    def _synthesize_hf(self) -> dict[str, Any]:
        skip = {"hf_config", "moe_layers", "qkv_bias", "o_bias", "qk_norm"}
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip
        }
        out.update(_built_families()[self.model_type].hf_fields(self))
        return out


def _built_families() -> dict[str, Family]:
    """The registered families `mxrl.models` builds (an HF architecture), by model_type."""
    from mxrl.arch import FAMILIES  # the registry imports the family files, which import this one

    return {f.model_type: f for f in FAMILIES if f.architecture is not None}


def _positive(name: str, value: int, why: str = "") -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r} {why}".rstrip())


def _head_dim(cfg: Mapping[str, Any], hidden: int, heads: int) -> int:
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if cfg["model_type"] == "qwen3":
        # transformers' Qwen3Config defaults head_dim to 128, mxrl.arch.hf (and the MoE configs)
        # to hidden_size // num_attention_heads: refuse to guess between them.
        raise ValueError(
            "config.json of model_type 'qwen3' lacks 'head_dim' (transformers would assume 128, "
            f"not hidden_size // num_attention_heads = {hidden // heads}); add it"
        )
    return hidden // heads


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(cfg.get("rope_theta") or DEFAULT_ROPE_THETA)


def _check_unsupported(cfg: Mapping[str, Any]) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise ValueError(f"{key} must be a JSON object or null, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"{key}: rope type {rope_type!r} is not supported; mxrl.models implements the "
                "default RoPE only (remove the scaling, or add the rope type to mxrl.models)"
            )
    if cfg.get("use_sliding_window"):
        raise ValueError(
            "use_sliding_window: true is not supported; mxrl.models implements full causal "
            "attention only (set use_sliding_window to false)"
        )
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"layer_types {sorted(set(layer_types))}: only 'full_attention' is supported"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; the SwiGLU MLPs here use 'silu'")
