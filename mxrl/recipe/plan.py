"""Plan: every tensor's format, resolved from a recipe against a model's tensors.

The plan hash is the precision contract trainer and engine compare before any exchange. It is the
sha256 of canonical JSON (sorted keys, no whitespace, tensors sorted by name) of
`{"schema": PLAN_SCHEMA_VERSION, "tensors": [{name, shape, format, activations, fuse_group,
block}, ...]}` — exactly what decides the bytes a quantizer writes. It leaves out rule provenance
(two recipes that assign the same formats give the same hash), the recipe name, and `backward`,
which changes how training computes gradients but not one byte of a weight or an activation.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from mxrl.arch.names import Kind, TensorInfo, classify_tensors, gate_up_group, is_matmul_weight
from mxrl.formats.constants import FP8_BLOCK_WEIGHT, Format, block_along_k
from mxrl.recipe.audit import format_summary, format_table
from mxrl.recipe.schema import ACTIVATIONS, Backward, Recipe, load_recipe

logger = logging.getLogger(__name__)

PLAN_SCHEMA_VERSION = 1
NOT_MATMUL = "not a matmul weight"
DEFAULT_RULE = "default"


@dataclass(frozen=True)
class TensorSpec:
    """How one tensor is stored and fed to its GEMM.

    activations: the NVFP4 activation global scale (per_token | per_tensor); None unless nvfp4.
      NVFP4 weights always carry one FP32 global scale per tensor (per expert for 3-D tensors).
    fuse_group: gate and up tensors with the same fuse_group share one NVFP4 global scale. A fused
      `gate_up_proj` tensor is its own group; when None, its gate and up halves get separate
      scales, as the per-expert layout would.
    block: fp8_block weight block (activations use (1, block[1])); None for other formats.
    rule: provenance for audits ("rules[2] {kind: routed_expert}", "default",
      "not a matmul weight"); not part of the hash.
    """

    name: str
    shape: tuple[int, ...]
    kind: Kind
    layer: int | None
    expert: int | None
    role: str
    format: Format
    activations: str | None = None
    fuse_group: str | None = None
    block: tuple[int, int] | None = None
    rule: str = DEFAULT_RULE

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "kind", Kind(self.kind))
        object.__setattr__(self, "format", Format(self.format))
        if self.block is not None:
            object.__setattr__(self, "block", tuple(int(b) for b in self.block))
        nvfp4 = self.format is Format.NVFP4
        if nvfp4 and self.activations not in ACTIVATIONS:
            raise ValueError(
                f"{self.name}: activations must be one of {ACTIVATIONS} for nvfp4, "
                f"got {self.activations!r}"
            )
        if not nvfp4 and (self.activations is not None or self.fuse_group is not None):
            raise ValueError(
                f"{self.name}: activations and fuse_group are nvfp4 fields; this tensor is "
                f"{self.format}, set them to None"
            )
        if (self.format is Format.FP8_BLOCK) != (self.block is not None):
            raise ValueError(f"{self.name}: block is set exactly when format is fp8_block")

    def contract(self) -> dict[str, Any]:
        """The hashed fields: what decides the bytes a quantizer writes for this tensor."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "format": self.format.value,
            "activations": self.activations,
            "fuse_group": self.fuse_group,
            "block": list(self.block) if self.block is not None else None,
        }

    def to_dict(self) -> dict[str, Any]:
        d = self.contract()
        d.update(
            kind=self.kind.value,
            layer=self.layer,
            expert=self.expert,
            role=self.role,
            rule=self.rule,
        )
        return d


@dataclass(frozen=True)
class Plan(Mapping[str, TensorSpec]):
    """tensor name -> TensorSpec, in the model's tensor order, plus the recipe's training mode."""

    recipe_name: str
    backward: Backward
    num_layers: int
    specs: tuple[TensorSpec, ...]
    # what the recipe says but this plan does not do (`check`); not part of the contract
    problems: tuple[str, ...] = field(default=(), compare=False)
    _index: dict[str, TensorSpec] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backward", Backward(self.backward))
        object.__setattr__(self, "specs", tuple(self.specs))
        object.__setattr__(self, "problems", tuple(self.problems))
        index = {s.name: s for s in self.specs}
        if len(index) != len(self.specs):
            counts = Counter(s.name for s in self.specs)
            dupes = sorted(name for name, n in counts.items() if n > 1)
            raise ValueError(f"specs: duplicate tensor names in a plan: {dupes[:5]}")
        object.__setattr__(self, "_index", index)

    def __getitem__(self, name: str) -> TensorSpec:
        return self._index[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self.specs)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def hash(self) -> str:
        """sha256 hex of the canonical contract JSON (module docstring says what it covers)."""
        return self._contract_hash

    @cached_property
    def _contract_hash(self) -> str:
        contract = {
            "schema": PLAN_SCHEMA_VERSION,
            "tensors": sorted((s.contract() for s in self.specs), key=lambda d: d["name"]),
        }
        text = json.dumps(contract, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode("ascii")).hexdigest()

    @property
    def quantized(self) -> bool:
        """Whether any tensor of the plan is stored in a low-precision format."""
        return any(s.format is not Format.BF16 for s in self.specs)

    def check(self, strict: bool = True) -> None:
        """Refuse (strict) or loudly warn about a plan that does not do what its recipe says:
        a name glob that matches no tensor, a low-precision rule that assigns none, a recipe
        that quantizes nothing in this model (`problems`, found by `resolve`)."""
        if not self.problems:
            return
        # one line: the CLI prints a refusal as one `mxrl: error:` line
        listed = "; ".join(self.problems)
        message = f"recipe {self.recipe_name!r} does not do what it says on this model: {listed}"
        if strict:
            raise ValueError(
                f"{message}. Fix the recipe's rules (`mxrl recipe show RECIPE --model DIR` prints "
                "the plan), or allow it explicitly (--allow-unmatched; `strict: false` in a "
                "train config)"
            )
        logger.warning("%s (allowed: not strict)", message)

    def summary(self) -> str:
        """The audit's per-format summary (what `convert` and `train` print first)."""
        return format_summary(self)

    def table(self) -> str:
        """The audit: one line per tensor (per expert group for per-expert tensors), a summary."""
        return format_table(self)

    def to_json(self, indent: int | None = None) -> str:
        """Everything (provenance and backward included); `Plan.from_json` inverts it."""
        data = {
            "schema": PLAN_SCHEMA_VERSION,
            "recipe_name": self.recipe_name,
            "backward": self.backward.value,
            "num_layers": self.num_layers,
            "hash": self.hash(),
            "problems": list(self.problems),
            "tensors": [s.to_dict() for s in self.specs],
        }
        return json.dumps(data, indent=indent, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        if data.get("schema") != PLAN_SCHEMA_VERSION:
            raise ValueError(
                f"plan schema {data.get('schema')!r} is not {PLAN_SCHEMA_VERSION}; re-resolve the "
                "recipe with this version of mxrl"
            )
        plan = cls(
            recipe_name=data["recipe_name"],
            backward=data["backward"],
            num_layers=int(data["num_layers"]),
            specs=tuple(TensorSpec(**t) for t in data["tensors"]),
            problems=tuple(data.get("problems", ())),
        )
        if "hash" in data and data["hash"] != plan.hash():
            raise ValueError(
                f"plan JSON says hash {data['hash']} but its tensors hash to {plan.hash()}: the "
                "file was edited or corrupted; re-resolve it from its recipe"
            )
        return plan


def resolve(
    recipe: Recipe | str | Path | Mapping[str, Any],
    tensors: Iterable[tuple[str, Sequence[int]]] | Mapping[str, Sequence[int]],
    num_layers: int | None = None,
) -> Plan:
    """Apply a recipe (Recipe, preset name, YAML path or dict) to (canonical name, shape) pairs
    (or a name -> shape mapping, e.g. `{k: v.shape for k, v in state_dict.items()}`).

    num_layers defaults to max layer index + 1 among the tensors. Raises ValueError for a shape
    that does not fit its format's block and for a gate/up pair resolved to different formats.
    """
    recipe = load_recipe(recipe)
    shapes: dict[str, tuple[int, ...]] = {}
    pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, shape in pairs:
        if name in shapes:
            raise ValueError(f"tensors: {name!r} is listed twice")
        shapes[name] = tuple(int(d) for d in shape)
    infos = classify_tensors(shapes)
    max_layer = max((i.layer for i in infos.values() if i.layer is not None), default=-1)
    if num_layers is None:
        num_layers = max_layer + 1
    elif num_layers <= max_layer:
        raise ValueError(
            f"num_layers={num_layers} but the tensors reach layer {max_layer}; pass "
            f"num_layers >= {max_layer + 1} or leave it None"
        )
    rule_layers = [
        r.match.layers.indices(num_layers) if r.match.layers is not None else None
        for r in recipe.rules
    ]
    provenances = [r.describe(i) for i, r in enumerate(recipe.rules)]
    num_rules = len(recipe.rules)
    selected, assigned = [0] * num_rules, [0] * num_rules  # tensors each rule matches / takes
    globbed: list[set[str]] = [set() for _ in recipe.rules]  # each rule's globs that matched
    specs = []
    for name, shape in shapes.items():
        info = infos[name]
        if not is_matmul_weight(name, info, shape):
            specs.append(_spec(name, shape, info, Format.BF16, None, None, None, NOT_MATMUL))
            continue
        hits = []
        for i, r in enumerate(recipe.rules):
            selects = r.match.selects(info, rule_layers[i])
            globs = r.match.globs_matching(name) if selects else ()
            globbed[i].update(globs)
            hits.append(selects and (r.match.name is None or bool(globs)))
        for i, hit in enumerate(hits):
            selected[i] += hit
        first = next((i for i, hit in enumerate(hits) if hit), None)
        if first is not None:
            rule = recipe.rules[first]
            assigned[first] += 1
            fmt, provenance = rule.format, provenances[first]
            acts, block, fuse = rule.activations, rule.block, rule.fuse is not None
        else:
            fmt, provenance, acts, block, fuse = recipe.default, DEFAULT_RULE, None, None, False
            if fmt is Format.NVFP4:
                acts = "per_token"
            elif fmt is Format.FP8_BLOCK:
                block = FP8_BLOCK_WEIGHT
        group = gate_up_group(name, info) if fuse else None
        _check_block(name, shape, fmt, block, provenance)
        specs.append(_spec(name, shape, info, fmt, acts, group, block, provenance))
    _check_fuse_groups(specs)
    problems = _problems(recipe, provenances, selected, assigned, globbed, specs)
    plan = Plan(recipe.name, recipe.backward, num_layers, tuple(specs), problems)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("recipe %s on %d tensors: plan %s", recipe.name, len(plan), plan.hash())
    return plan


def _problems(
    recipe: Recipe,
    provenances: list[str],
    selected: list[int],
    assigned: list[int],
    globbed: list[set[str]],
    specs: list[TensorSpec],
) -> tuple[str, ...]:
    """What the recipe says but the plan does not do (`Plan.check`). A bf16 rule selecting a
    kind or layers that this model lacks is fine (presets serve many families); a name glob
    that matches nothing is probably a typo whatever its format — each glob of a list on its
    own, since one good glob would hide a typo in the next — and a low-precision rule that
    takes no tensor quantizes nothing it was written for."""
    out = []
    for i, rule in enumerate(recipe.rules):
        where = provenances[i]
        if selected[i] == 0 and (rule.match.name is not None or rule.format is not Format.BF16):
            hint = " (a typo in the glob?)" if rule.match.name is not None else ""
            out.append(f"{where} -> {rule.format} matches no tensor of this model{hint}")
            continue
        for glob in rule.match.name or ():
            if glob not in globbed[i]:
                out.append(
                    f"{where} -> {rule.format}: its glob {glob!r} matches no tensor of this "
                    "model that the rule's other selectors allow (a typo in the glob?)"
                )
        if selected[i] and not assigned[i] and rule.format is not Format.BF16:
            out.append(
                f"{where} -> {rule.format}: every tensor it matches ({selected[i]}) is taken by "
                "an earlier rule"
            )
    asks = recipe.default is not Format.BF16 or any(
        r.format is not Format.BF16 for r in recipe.rules
    )
    if asks and not any(s.format is not Format.BF16 for s in specs):
        out.append(
            f"recipe {recipe.name!r} asks for low precision, but every tensor of this model "
            "resolves to bf16: it quantizes nothing here"
        )
    return tuple(out)


def _spec(name, shape, info: TensorInfo, fmt, acts, group, block, rule) -> TensorSpec:
    return TensorSpec(
        name=name,
        shape=shape,
        kind=info.kind,
        layer=info.layer,
        expert=info.expert,
        role=info.role,
        format=fmt,
        activations=acts,
        fuse_group=group,
        block=block,
        rule=rule,
    )


def _check_block(
    name: str,
    shape: tuple[int, ...],
    fmt: Format,
    block: tuple[int, int] | None,
    provenance: str,
) -> None:
    if fmt is Format.BF16:
        return
    k = block[1] if block is not None else block_along_k(fmt)
    if shape[-1] % k:
        raise ValueError(
            f"tensor {name!r} of shape {shape} cannot be {fmt}: its last (reduction) dim "
            f"{shape[-1]} is not a multiple of the {fmt} block ({k}); it was chosen by "
            f"{provenance}. Fix: add a rule `- match: {{name: {name!r}}}` with format: bf16 "
            "before that rule, or narrow that rule's match"
        )


def _check_fuse_groups(specs: list[TensorSpec]) -> None:
    """Gate and up of one group must resolve to the same format, options and group."""
    by_group: dict[str, list[TensorSpec]] = {}
    for s in specs:
        if s.fuse_group is not None:
            by_group.setdefault(s.fuse_group, []).append(s)
    index = {s.name: s for s in specs}
    for group, members in by_group.items():
        if len(members) == 1 and members[0].role == "gate_up":
            continue
        gate = group.removesuffix(".gate_up") + ".gate_proj.weight"
        up = group.removesuffix(".gate_up") + ".up_proj.weight"
        pair = [index.get(gate), index.get(up)]
        if any(p is None for p in pair):
            missing = gate if pair[0] is None else up
            raise ValueError(
                f"fuse: [gate, up] groups {group!r}, but {missing!r} is not among the tensors; "
                "both halves are needed to share one global scale"
            )
        a, b = pair
        assert a is not None and b is not None
        if (a.format, a.activations, a.fuse_group) != (b.format, b.activations, b.fuse_group):
            raise ValueError(
                f"fuse: [gate, up] needs {a.name!r} and {b.name!r} in one format, but they "
                f"resolved to {_describe(a)} ({a.rule}) and {_describe(b)} ({b.rule}). Fix: give "
                "gate and up the same rule (match both names, or match by kind)"
            )


def _describe(s: TensorSpec) -> str:
    parts = [s.format.value]
    if s.activations:
        parts.append(s.activations)
    parts.append("fused" if s.fuse_group else "not fused")
    return " ".join(parts)
