"""Recipes: ordered rules, first match wins (docs/design.md §6).

```yaml
name: nvfp4-dequantized
backward: dequantized            # high_precision | dequantized | quantized (MXFP8, block FP8)
default: bf16
rules:
  - match: {layers: "last 15%"}
    format: bf16
  - match: {kind: routed_expert}
    format: nvfp4
    activations: per_token
    fuse: [gate, up]
    scale_mode: 4over6           # optional, nvfp4 only: te (default) | 4over6
```

Recipe keys: name (defaults to the file stem when loaded from a file), description (optional, one
line, shown by `mxrl recipe list`), backward (default high_precision), default (default bf16),
kv_cache (default compute: keys and values in the compute dtype; fp8: E4M3 with one fp32 scale per
token and KV head, the rollout engine's cache and the trainer's attention alike), rules (default
[]). Rule keys: match, format, activations, fuse, block, scale_mode. Match keys: name, kind,
layers. Unknown keys and bad values raise ValueError naming the key, where it is, and the fix.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from mxrl.arch.names import Kind, TensorInfo
from mxrl.formats.constants import FP8_BLOCK_WEIGHT, Format
from mxrl.recipe.layers import LayerSelector, parse_layers
from mxrl.runs.yamlio import load_yaml


class Backward(StrEnum):
    """How backward GEMMs see quantized operands (docs/design.md §7)."""

    HIGH_PRECISION = "high_precision"
    DEQUANTIZED = "dequantized"
    QUANTIZED = "quantized"


class KVCacheFormat(StrEnum):
    """How attention keys and values are held (docs/recipes.md, "The KV cache")."""

    COMPUTE = "compute"  # in the run's compute dtype (bf16 on CUDA, fp32 on the CPU)
    FP8 = "fp8"  # E4M3, one fp32 scale per token and KV head (block FP8 in 1 x head_dim blocks)


ACTIVATIONS = ("per_token", "per_tensor")
# NVFP4 block-scale rules a recipe may choose (`mxrl.formats.quantize`'s scale_mode; the
# reference's comparison-only "torchao" is not one): "te" is the default and is stored as None,
# so it hashes as a rule without the key; "4over6" applies to the weights and the activations.
NVFP4_SCALE_MODES = ("te", "4over6")
FUSE_GATE_UP = ("gate", "up")
RECIPE_KEYS = ("name", "description", "backward", "default", "kv_cache", "rules")
RULE_KEYS = ("match", "format", "activations", "fuse", "block", "scale_mode")
MATCH_KEYS = ("name", "kind", "layers")
_QUANTIZED_BACKWARD_FORMATS = (Format.BF16, Format.MXFP8, Format.FP8_BLOCK)
E = TypeVar("E", bound=StrEnum)


def _choices(enum: type[StrEnum]) -> str:
    return ", ".join(e.value for e in enum)


def _coerce(enum: type[E], value: object, field_name: str, what: str) -> E:
    """enum(value), or a ValueError naming the field, the value and the choices."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(
            f"{field_name}: unknown {what} {value!r}; use one of {_choices(enum)}"
        ) from None


def _as_tuple(value: object, field_name: str) -> tuple[Any, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and value:
        return tuple(value)
    raise ValueError(f"{field_name}: expected a string or a non-empty list, got {value!r}")


@dataclass(frozen=True)
class Match:
    """Selectors of one rule; every given selector must match (no selector matches everything)."""

    name: tuple[str, ...] | None = None
    kind: tuple[Kind, ...] | None = None
    layers: LayerSelector | None = None

    def __post_init__(self) -> None:
        if self.name is not None:
            names = _as_tuple(self.name, "match.name")
            if not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"match.name: globs must be non-empty strings, got {names!r}")
            object.__setattr__(self, "name", names)
        if self.kind is not None:
            kinds = tuple(
                _coerce(Kind, k, "match.kind", "kind") for k in _as_tuple(self.kind, "match.kind")
            )
            object.__setattr__(self, "kind", kinds)
        if self.layers is not None and not isinstance(self.layers, LayerSelector):
            object.__setattr__(self, "layers", parse_layers(self.layers))

    def matches(self, name: str, info: TensorInfo, layers: frozenset[int] | None) -> bool:
        """`layers` is this rule's `self.layers.indices(num_layers)`, computed once per plan."""
        if not self.selects(info, layers):
            return False
        return self.name is None or any(fnmatch.fnmatchcase(name, g) for g in self.name)

    def selects(self, info: TensorInfo, layers: frozenset[int] | None) -> bool:
        """The `kind` and `layers` selectors alone (`name` aside)."""
        if self.kind is not None and info.kind not in self.kind:
            return False
        if self.layers is not None:
            assert layers is not None
            if info.layer is None or info.layer not in layers:
                return False
        return True

    def globs_matching(self, name: str) -> tuple[str, ...]:
        """The `name` globs that match `name` (a strict plan wants every glob to match one)."""
        return tuple(g for g in self.name or () if fnmatch.fnmatchcase(name, g))

    def describe(self) -> str:
        """`{kind: routed_expert, layers: last 15%}`, for audit tables and error messages."""
        parts = []
        for key, values in (("name", self.name), ("kind", self.kind)):
            if values is not None:
                text = values[0] if len(values) == 1 else "[" + ", ".join(values) + "]"
                parts.append(f"{key}: {text}")
        if self.layers is not None:
            parts.append(f"layers: {self.layers.text}")
        return "{" + ", ".join(parts) + "}"


@dataclass(frozen=True)
class Rule:
    """One recipe rule: selectors and the format (with its options) they assign."""

    match: Match = field(default_factory=Match)
    format: Format = Format.BF16
    activations: str | None = None
    fuse: tuple[str, ...] | None = None
    block: tuple[int, int] | None = None
    scale_mode: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", _coerce(Format, self.format, "format", "format"))
        nvfp4 = self.format is Format.NVFP4
        object.__setattr__(self, "scale_mode", _parse_scale_mode(self.scale_mode, self.format))
        if self.activations is not None and not nvfp4:
            raise ValueError(
                f"activations: only nvfp4 has an activation global scale (this rule is "
                f"{self.format}); remove 'activations' or set format: nvfp4"
            )
        if nvfp4:
            acts = self.activations or "per_token"
            if acts not in ACTIVATIONS:
                raise ValueError(
                    f"activations: {acts!r} is not one of {', '.join(ACTIVATIONS)}; per_token "
                    "gives every token its own FP32 scale (batch-invariant)"
                )
            object.__setattr__(self, "activations", acts)
        if self.fuse is not None:
            fuse = _as_tuple(self.fuse, "fuse")
            if tuple(sorted(fuse)) != FUSE_GATE_UP:
                raise ValueError(f"fuse: only [gate, up] is supported, got {list(fuse)}")
            if not nvfp4:
                raise ValueError(
                    f"fuse: [gate, up] shares one NVFP4 global scale; {self.format} has none. "
                    "Remove 'fuse' or set format: nvfp4"
                )
            object.__setattr__(self, "fuse", FUSE_GATE_UP)
        if self.block is not None and self.format is not Format.FP8_BLOCK:
            raise ValueError(
                f"block: only fp8_block has a configurable block ({self.format} is fixed); "
                "remove 'block' or set format: fp8_block"
            )
        if self.format is Format.FP8_BLOCK:
            object.__setattr__(self, "block", _parse_block(self.block))

    def describe(self, index: int) -> str:
        return f"rules[{index}] {self.match.describe()}"


def _parse_scale_mode(scale_mode: object, fmt: Format) -> str | None:
    """None (the default block scales) or "4over6"; refused for a format other than nvfp4."""
    if scale_mode is None:
        return None
    if fmt is not Format.NVFP4:
        raise ValueError(
            f"scale_mode: only nvfp4 has a block-scale rule a recipe chooses (te, 4over6); "
            f"this rule is {fmt}. Remove 'scale_mode' or set format: nvfp4"
        )
    if scale_mode not in NVFP4_SCALE_MODES:
        raise ValueError(
            f"scale_mode: {scale_mode!r} is not one of {', '.join(NVFP4_SCALE_MODES)}; te is the "
            "standard NVFP4 block scale (the default), 4over6 maps each 16-value block's amax "
            "to 6 or to 4, whichever gives the lower error (docs/formats.md, NVFP4 4over6)"
        )
    return None if scale_mode == "te" else str(scale_mode)


def _parse_block(block: object) -> tuple[int, int]:
    if block is None:
        return FP8_BLOCK_WEIGHT
    ok = (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    )
    if not ok or block[0] != block[1]:
        raise ValueError(
            f"block: expected a square weight block [b, b] of positive ints (activations use "
            f"[1, b]), got {block!r}; the DeepSeek-V3 block is [128, 128]"
        )
    return (int(block[0]), int(block[1]))


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe. `backward` affects training only; `rules` decide every tensor's format."""

    name: str
    backward: Backward = Backward.HIGH_PRECISION
    default: Format = Format.BF16
    rules: tuple[Rule, ...] = ()
    description: str = ""
    kv_cache: KVCacheFormat = KVCacheFormat.COMPUTE

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("name: a recipe needs a non-empty name (e.g. name: my-nvfp4)")
        object.__setattr__(self, "backward", _coerce(Backward, self.backward, "backward", "mode"))
        kv = _coerce(KVCacheFormat, self.kv_cache, "kv_cache", "format")
        object.__setattr__(self, "kv_cache", kv)
        object.__setattr__(self, "default", _coerce(Format, self.default, "default", "format"))
        if not isinstance(self.description, str):
            raise ValueError(f"description: expected one line of text, got {self.description!r}")
        object.__setattr__(self, "rules", tuple(self.rules))
        if self.backward is Backward.QUANTIZED:
            used = [("default", self.default)] + [
                (f"rules[{i}]", r.format) for i, r in enumerate(self.rules)
            ]
            for where, fmt in used:
                if fmt not in _QUANTIZED_BACKWARD_FORMATS:
                    raise ValueError(
                        f"backward: quantized runs the backward GEMMs in MXFP8 or block FP8 and "
                        f"is defined for mxfp8 and fp8_block only, but {where} uses {fmt}. Use "
                        "backward: dequantized or high_precision (no NVFP4 mode runs backward "
                        "GEMMs in FP4)"
                    )


def _check_keys(data: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in data:
        if key not in allowed:
            raise ValueError(f"{where}: unknown key {key!r}; allowed keys are {', '.join(allowed)}")


def recipe_from_dict(data: Mapping[str, Any], *, default_name: str | None = None) -> Recipe:
    """A Recipe from parsed YAML/JSON; errors name the recipe, the rule index and the field."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a recipe is a mapping with keys {', '.join(RECIPE_KEYS)}, got {data!r}")
    label = str(data.get("name") or default_name or "<unnamed>")
    where = f"recipe {label!r}"
    _check_keys(data, RECIPE_KEYS, where)
    raw_rules = data.get("rules") or []
    if not isinstance(raw_rules, list):
        raise ValueError(f"{where}: rules: expected a list of rules, got {raw_rules!r}")
    rules = []
    for i, raw in enumerate(raw_rules):
        rule_where = f"{where} rules[{i}]"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{rule_where}: expected a mapping with keys {', '.join(RULE_KEYS)}")
        _check_keys(raw, RULE_KEYS, rule_where)
        if "format" not in raw:
            raise ValueError(f"{rule_where}: missing 'format'; use one of {_choices(Format)}")
        raw_match = raw.get("match") or {}
        if not isinstance(raw_match, Mapping):
            raise ValueError(
                f"{rule_where}: match: expected a mapping of selectors, got {raw_match!r}"
            )
        _check_keys(raw_match, MATCH_KEYS, f"{rule_where} match")
        try:
            match = Match(**raw_match)
            rule = Rule(match=match, **{k: v for k, v in raw.items() if k != "match"})
        except ValueError as e:
            raise ValueError(f"{rule_where}: {e}") from None
        rules.append(rule)
    given = ("backward", "default", "description", "kv_cache")
    kwargs = {k: data[k] for k in given if data.get(k) is not None}
    try:
        return Recipe(name=data.get("name") or default_name or "", rules=tuple(rules), **kwargs)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _preset_dir() -> Path:
    return Path(str(resources.files("mxrl.recipe") / "presets"))


def list_presets() -> list[str]:
    """Names of the built-in recipes (`mxrl/recipe/presets/*.yaml`), sorted."""
    return sorted(p.stem for p in _preset_dir().glob("*.yaml"))


def load_recipe(recipe: Recipe | str | Path | Mapping[str, Any]) -> Recipe:
    """A Recipe from a Recipe, a preset name, a YAML file path, or a dict."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, Mapping):
        return recipe_from_dict(recipe)
    if not isinstance(recipe, (str, Path)):
        raise TypeError(f"recipe: expected a Recipe, preset name, path or dict, got {recipe!r}")
    if isinstance(recipe, str) and recipe in list_presets():
        path = _preset_dir() / f"{recipe}.yaml"
    else:
        path = Path(recipe)
        if not path.is_file():
            raise ValueError(
                f"recipe {str(recipe)!r}: no such preset or file; presets are "
                f"{', '.join(list_presets())}"
            )
    data = load_yaml(path, f"recipe file {str(path)!r}")  # one line; duplicate keys refused
    if data is None:
        raise ValueError(f"recipe file {str(path)!r} is empty")
    return recipe_from_dict(data, default_name=path.stem)
