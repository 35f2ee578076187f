"""ModelConfig: the architecture of a Qwen3 / Qwen3-MoE / Qwen2-MoE / DeepSeek-V3 model, read from
config.json.

One dataclass for the families; the family only decides a few switches (q/k RMSNorm, which
projections carry a bias, which layers are MoE, whether they have a shared expert, MLA and the
sigmoid router of DeepSeek-V3): its file's `config_fields` and `hf_fields` (`mxrl.arch.qwen3`,
`qwen3_moe`, `qwen2_moe`, `deepseek_v3`). The HF dict the config was
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
# the rope_scaling / rope_parameters keys of a yarn config mxrl.models reads (mxrl.models.yarn;
# others are refused)
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)
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
    # DeepSeek-V3's router (scoring_func "sigmoid"): sigmoid scores, e_score_correction_bias for
    # the selection only, top-k within the topk_group best of n_group groups, weights times
    # routed_scaling_factor; its shared experts (shared_expert_intermediate_size) have no gate.
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # MLA (kv_lora_rank > 0, DeepSeek-V3): head_dim is then the RoPE part of a q/k head
    # (qk_rope_head_dim), q_lora_rank 0 a single q_proj
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # YaRN RoPE scaling (a family with "yarn" in its rope_types, mxrl.models.yarn): the sorted
    # (key, value) pairs of its parameters, factor and original_max_position_embeddings always
    # set; (): default RoPE
    rope_scaling: tuple[tuple[str, Any], ...] = ()
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
        _check_router(self)
        if self.is_mla:
            for name in ("qk_nope_head_dim", "v_head_dim"):
                _positive(name, getattr(self, name), "(MLA: kv_lora_rank > 0)")
            if self.q_lora_rank < 0:
                raise ValueError(f"q_lora_rank must be >= 0 (0: q_proj), got {self.q_lora_rank}")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3) instead of grouped-query attention."""
        return self.kv_lora_rank > 0

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
        _check_unsupported(cfg, built[model_type].rope_types)
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
            "rope_scaling": _rope_scaling(cfg),
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
        skip = {"hf_config", "moe_layers", "qkv_bias", "o_bias", "qk_norm"} | _FAMILY_ONLY
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip
        }
        out.update(_built_families()[self.model_type].hf_fields(self))
        return out


# fields that only a family's hf_fields writes (under its own config.json keys)
_FAMILY_ONLY = {
    "scoring_func",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
    "rope_interleave",
    "rope_scaling",
}


def _check_router(c: ModelConfig) -> None:
    """The sigmoid router's grouping: n_group groups of at least 2 experts (each group is scored
    by its two best), topk_group of them kept, enough experts in them for the top-k."""
    if c.scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func {c.scoring_func!r}: 'softmax' or 'sigmoid'")
    if c.scoring_func == "softmax" and (c.n_group, c.topk_group) != (1, 1):
        raise ValueError("n_group / topk_group are the sigmoid router's (DeepSeek-V3) only")
    if not c.moe_layers or c.scoring_func == "softmax":
        return
    _positive("n_group", c.n_group)
    if c.num_experts % c.n_group or c.num_experts // c.n_group < 2:
        raise ValueError(
            f"n_group ({c.n_group}) must divide n_routed_experts ({c.num_experts}) into groups "
            "of at least 2 experts (a group is scored by its two best)"
        )
    if not 0 < c.topk_group <= c.n_group:
        raise ValueError(f"topk_group ({c.topk_group}) must be in 1..n_group ({c.n_group})")
    if c.num_experts_per_tok > c.topk_group * (c.num_experts // c.n_group):
        raise ValueError(
            f"num_experts_per_tok ({c.num_experts_per_tok}) exceeds the experts of the "
            f"topk_group ({c.topk_group}) groups kept, {c.topk_group * (c.num_experts // c.n_group)}"
        )
    if not c.routed_scaling_factor > 0:
        raise ValueError(f"routed_scaling_factor must be > 0, got {c.routed_scaling_factor}")


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


def _rope_dicts(cfg: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], str]]:
    """(key, dict, rope type) of the config's rope_parameters / rope_scaling objects."""
    out = []
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise ValueError(f"{key} must be a JSON object or null, got {rope!r}")
        out.append((key, rope, rope.get("rope_type", rope.get("type", "default"))))
    return out


def _rope_scaling(cfg: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """`ModelConfig.rope_scaling` of a config whose rope type is yarn (checked before), with
    transformers' default original_max_position_embeddings = max_position_embeddings."""
    for key, rope, rope_type in _rope_dicts(cfg):
        if rope_type != "yarn":
            continue
        unknown = sorted(set(rope) - set(YARN_KEYS) - {"type", "rope_type", "rope_theta"})
        if unknown:
            raise ValueError(
                f"{key}: yarn parameter(s) {unknown} are not supported; mxrl.models reads "
                f"{', '.join(YARN_KEYS)}"
            )
        params = {k: rope[k] for k in YARN_KEYS if rope.get(k) is not None}
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        if params["original_max_position_embeddings"] is None:
            raise ValueError(f"{key}: yarn needs original_max_position_embeddings; add it")
        if "factor" not in params:  # transformers 5.24's DeepSeek-V3 fails on a null factor
            raise ValueError(f"{key}: yarn needs its factor (the context extension); add it")
        return tuple(sorted(params.items()))
    return ()


def _check_unsupported(cfg: Mapping[str, Any], rope_types: tuple[str, ...]) -> None:
    for key, _, rope_type in _rope_dicts(cfg):
        if rope_type not in rope_types:
            raise ValueError(
                f"{key}: rope type {rope_type!r} is not supported; mxrl.models implements "
                f"{' and '.join(repr(t) for t in rope_types)} RoPE for model_type "
                f"{cfg.get('model_type')!r} (remove the scaling, or add the rope type to "
                "mxrl.models)"
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
