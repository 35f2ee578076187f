"""Canonical HF tensor names -> (kind, layer, expert, role).

Supported families (the names `transformers` writes in `model.state_dict()` and in published
safetensors checkpoints):

- qwen3 (dense): attention q/k/v/o (+ q_norm/k_norm), dense SwiGLU MLP.
- qwen3_moe: router `mlp.gate.weight`; routed experts either per expert
  (`mlp.experts.{i}.{gate,up,down}_proj.weight`, as in the published Qwen3-30B-A3B checkpoint) or
  fused 3-D (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, as transformers >= 5 writes them;
  layout in `mxrl.arch.hf`).
- qwen2_moe: as qwen3_moe plus `mlp.shared_expert.*` and the 1xH `mlp.shared_expert_gate.weight`.
- deepseek_v3: MLA attention (`q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`,
  or `q_proj` when q_lora_rank is null), router weight + `e_score_correction_bias`,
  `mlp.shared_experts.*`.

`self_attn.o_proj` (and `self_attn.q_proj`) exist in both standard and MLA attention, so the name
alone cannot tell them apart: pass `mla_attention=True`, or use `classify_tensors`, which detects
MLA layers from their other projections.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import StrEnum
from typing import NamedTuple

SUPPORTED_FAMILIES = ("qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3")


class Kind(StrEnum):
    """What a tensor is, for recipe `kind` selectors."""

    EMBEDDING = "embedding"
    ATTENTION = "attention"
    MLA = "mla"
    ROUTER = "router"
    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    DENSE_MLP = "dense_mlp"
    LM_HEAD = "lm_head"
    NORM = "norm"


class TensorInfo(NamedTuple):
    """What `classify` says about one tensor name."""

    kind: Kind
    layer: int | None
    expert: int | None
    role: str


# Whole-model tensors (no layer).
_GLOBAL = {
    "model.embed_tokens.weight": (Kind.EMBEDDING, "embed"),
    "model.norm.weight": (Kind.NORM, "final_norm"),
    "lm_head.weight": (Kind.LM_HEAD, "lm_head"),
}

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_PARAM = r"(?:weight|bias)"

# (pattern over the part after `model.layers.{L}.`, kind, role or None = taken from group "role").
_LAYER_PATTERNS: tuple[tuple[re.Pattern[str], Kind, str | None], ...] = tuple(
    (re.compile(p), kind, role)
    for p, kind, role in (
        (r"input_layernorm\.weight", Kind.NORM, "input_norm"),
        (r"post_attention_layernorm\.weight", Kind.NORM, "post_attention_norm"),
        (rf"self_attn\.(?P<role>q|k|v|o)_proj\.{_PARAM}", Kind.ATTENTION, None),
        (r"self_attn\.(?P<role>q|k)_norm\.weight", Kind.NORM, None),
        (rf"self_attn\.(?P<role>q_a|q_b|kv_b)_proj\.{_PARAM}", Kind.MLA, None),
        (rf"self_attn\.kv_a_proj_with_mqa\.{_PARAM}", Kind.MLA, "kv_a"),
        (r"self_attn\.(?P<role>q_a|kv_a)_layernorm\.weight", Kind.NORM, None),
        (r"mlp\.(?P<role>gate|up|down)_proj\.weight", Kind.DENSE_MLP, None),
        (r"mlp\.gate\.weight", Kind.ROUTER, "router"),
        (r"mlp\.gate\.e_score_correction_bias", Kind.ROUTER, "router_bias"),
        (r"mlp\.shared_expert_gate\.weight", Kind.ROUTER, "shared_expert_gate"),
        (
            r"mlp\.experts\.(?P<expert>\d+)\.(?P<role>gate|up|down)_proj\.weight",
            Kind.ROUTED_EXPERT,
            None,
        ),
        (r"mlp\.experts\.(?P<role>gate_up|down)_proj", Kind.ROUTED_EXPERT, None),
        (r"mlp\.shared_experts?\.(?P<role>gate|up|down)_proj\.weight", Kind.SHARED_EXPERT, None),
    )
)

# Projections whose presence in a layer marks its attention as MLA.
_MLA_MARKERS = ("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa.", "self_attn.kv_b_proj.")
_NORM_ROLES = {"q": "q_norm", "k": "k_norm", "q_a": "q_a_norm", "kv_a": "kv_a_norm"}


def classify(name: str, *, mla_attention: bool = False) -> TensorInfo:
    """Kind, layer index, expert index and role of a canonical HF tensor name.

    role is the projection (q, k, v, o, q_a, q_b, kv_a, kv_b, gate, up, down, gate_up) or what the
    tensor is (embed, lm_head, router, router_bias, shared_expert_gate, input_norm, q_norm, ...).
    `mla_attention=True` classifies `self_attn.{q,o}_proj` as MLA (DeepSeek-V3) instead of
    standard attention. Raises ValueError for a name outside the supported families.
    """
    if name in _GLOBAL:
        kind, role = _GLOBAL[name]
        return TensorInfo(kind, None, None, role)
    m = _LAYER_RE.fullmatch(name)
    if m is not None:
        layer, rest = int(m.group(1)), m.group(2)
        for pattern, kind, role in _LAYER_PATTERNS:
            pm = pattern.fullmatch(rest)
            if pm is None:
                continue
            groups = pm.groupdict()
            role = role or groups["role"]
            if kind is Kind.NORM and role in _NORM_ROLES:
                role = _NORM_ROLES[role]
            if kind is Kind.ATTENTION and mla_attention:
                kind = Kind.MLA
            expert = int(groups["expert"]) if groups.get("expert") is not None else None
            return TensorInfo(kind, layer, expert, role)
    raise ValueError(
        f"unrecognised tensor name {name!r}: mxrl.recipe knows the canonical Hugging Face names "
        f"of the {', '.join(SUPPORTED_FAMILIES)} families (e.g. "
        "'model.layers.0.self_attn.q_proj.weight', 'model.layers.0.mlp.experts.3.up_proj.weight'"
        "). Rename the tensor to the HF convention before resolving a recipe."
    )


def mla_layers(names: Iterable[str]) -> set[int]:
    """Layer indices whose attention is MLA (a q_a_proj, kv_a_proj_with_mqa or kv_b_proj is there)."""
    layers: set[int] = set()
    for name in names:
        m = _LAYER_RE.fullmatch(name)
        if m is not None and m.group(2).startswith(_MLA_MARKERS):
            layers.add(int(m.group(1)))
    return layers


def classify_tensors(names: Iterable[str]) -> dict[str, TensorInfo]:
    """`classify` for a whole model, with MLA attention detected per layer."""
    names = list(names)
    mla = mla_layers(names)
    out: dict[str, TensorInfo] = {}
    for name in names:
        m = _LAYER_RE.fullmatch(name)
        in_mla_layer = m is not None and int(m.group(1)) in mla
        out[name] = classify(name, mla_attention=in_mla_layer)
    return out


def is_matmul_weight(name: str, info: TensorInfo, shape: tuple[int, ...]) -> bool:
    """Whether recipe rules apply: the 2-D `.weight` of a linear or embedding module, or a 3-D
    fused expert tensor. Norm weights, biases and DeepSeek's e_score_correction_bias are not."""
    if info.kind is Kind.NORM:
        return False
    if info.kind is Kind.ROUTED_EXPERT and info.expert is None and not name.endswith(".weight"):
        return len(shape) == 3
    return name.endswith(".weight") and len(shape) == 2


def gate_up_group(name: str, info: TensorInfo) -> str | None:
    """The shared name of a gate/up pair (one NVFP4 global scale), or None for other roles.

    `model.layers.0.mlp.experts.3.gate_proj.weight` -> `model.layers.0.mlp.experts.3.gate_up`;
    a fused `...mlp.experts.gate_up_proj` tensor is its own group (its name).
    """
    if info.role == "gate_up":
        return name
    if info.role in ("gate", "up") and info.kind in (
        Kind.ROUTED_EXPERT,
        Kind.SHARED_EXPERT,
        Kind.DENSE_MLP,
    ):
        return name.removesuffix(f".{info.role}_proj.weight") + ".gate_up"
    return None
