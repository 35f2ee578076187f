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

The layer tensors' patterns are grouped in `Piece`s (attention, q/k norm, MLA, dense MLP, router,
routed experts, shared expert(s)); each family file (`mxrl.arch.qwen3`, ...) lists the pieces it is
made of, and no name matches two pieces.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import StrEnum
from typing import NamedTuple


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


class Piece(NamedTuple):
    """A named group of tensor-name patterns that families are made of (docs/design.md §4.3):
    each pattern (over the part of the name after `model.layers.{L}.`) with its Kind and role
    (None: taken from the pattern's group "role")."""

    name: str
    patterns: tuple[tuple[re.Pattern[str], Kind, str | None], ...]


def _piece(name: str, *patterns: tuple[str, Kind, str | None]) -> Piece:
    return Piece(name, tuple((re.compile(p), kind, role) for p, kind, role in patterns))


# Whole-model tensors (no layer), in every family.
_GLOBAL = {
    "model.embed_tokens.weight": (Kind.EMBEDDING, "embed"),
    "model.norm.weight": (Kind.NORM, "final_norm"),
    "lm_head.weight": (Kind.LM_HEAD, "lm_head"),
}

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_PARAM = r"(?:weight|bias)"

LAYER_NORMS = _piece(
    "layer_norms",
    (r"input_layernorm\.weight", Kind.NORM, "input_norm"),
    (r"post_attention_layernorm\.weight", Kind.NORM, "post_attention_norm"),
)
ATTENTION = _piece(
    "attention", (rf"self_attn\.(?P<role>q|k|v|o)_proj\.{_PARAM}", Kind.ATTENTION, None)
)
QK_NORM = _piece("qk_norm", (r"self_attn\.(?P<role>q|k)_norm\.weight", Kind.NORM, None))
MLA = _piece(
    "mla",
    (rf"self_attn\.(?P<role>q_a|q_b|kv_b)_proj\.{_PARAM}", Kind.MLA, None),
    (rf"self_attn\.kv_a_proj_with_mqa\.{_PARAM}", Kind.MLA, "kv_a"),
    (r"self_attn\.(?P<role>q_a|kv_a)_layernorm\.weight", Kind.NORM, None),
)
DENSE_MLP = _piece("dense_mlp", (r"mlp\.(?P<role>gate|up|down)_proj\.weight", Kind.DENSE_MLP, None))
ROUTER = _piece("router", (r"mlp\.gate\.weight", Kind.ROUTER, "router"))
ROUTER_BIAS = _piece(
    "router_bias", (r"mlp\.gate\.e_score_correction_bias", Kind.ROUTER, "router_bias")
)
ROUTED_EXPERTS = _piece(
    "routed_experts",
    (
        r"mlp\.experts\.(?P<expert>\d+)\.(?P<role>gate|up|down)_proj\.weight",
        Kind.ROUTED_EXPERT,
        None,
    ),
    (r"mlp\.experts\.(?P<role>gate_up|down)_proj", Kind.ROUTED_EXPERT, None),
)
SHARED_EXPERT = _piece(  # Qwen: one shared expert and its sigmoid gate
    "shared_expert",
    (r"mlp\.shared_expert\.(?P<role>gate|up|down)_proj\.weight", Kind.SHARED_EXPERT, None),
    (r"mlp\.shared_expert_gate\.weight", Kind.ROUTER, "shared_expert_gate"),
)
SHARED_EXPERTS = _piece(  # DeepSeek: n_shared_experts fused into one SwiGLU
    "shared_experts",
    (r"mlp\.shared_experts\.(?P<role>gate|up|down)_proj\.weight", Kind.SHARED_EXPERT, None),
)

# Every piece a registered family is made of (tests/arch/test_family.py checks that they are
# the same set, and that no tensor name of any family matches two of them, so the order in which
# `classify` tries them does not matter).
PIECES = (
    LAYER_NORMS,
    ATTENTION,
    QK_NORM,
    MLA,
    DENSE_MLP,
    ROUTER,
    ROUTER_BIAS,
    ROUTED_EXPERTS,
    SHARED_EXPERT,
    SHARED_EXPERTS,
)


def matching_pieces(name: str) -> list[Piece]:
    """The pieces with a pattern that matches the layer tensor `name` (whole-model names: none)."""
    m = _LAYER_RE.fullmatch(name)
    if m is None:
        return []
    rest = m.group(2)
    return [p for p in PIECES if any(pat.fullmatch(rest) for pat, _, _ in p.patterns)]


# Projections whose presence in a layer marks its attention as MLA.
_MLA_MARKERS = ("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa.", "self_attn.kv_b_proj.")
_NORM_ROLES = {"q": "q_norm", "k": "k_norm", "q_a": "q_a_norm", "kv_a": "kv_a_norm"}
_LAYER_PATTERNS = tuple(pattern for piece in PIECES for pattern in piece.patterns)


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
    from mxrl.arch import FAMILIES  # the registry imports the family files, which import this one

    raise ValueError(
        f"unrecognised tensor name {name!r}: mxrl.recipe knows the canonical Hugging Face names "
        f"of the {', '.join(f.model_type for f in FAMILIES)} families (e.g. "
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


# Tensors kept in fp32 whatever the model or checkpoint dtype (transformers'
# `_keep_in_fp32_modules_strict` of DeepSeek-V3: the router's selection bias).
FP32_SUFFIXES = (".e_score_correction_bias",)


def keeps_fp32(name: str) -> bool:
    """Whether tensor `name` stays fp32 when a model or checkpoint is cast (`FP32_SUFFIXES`)."""
    return name.endswith(FP32_SUFFIXES)


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
