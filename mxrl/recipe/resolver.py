"""resolve: a recipe applied to a model's tensors, the `Plan` (`mxrl.recipe.plan`) of every
tensor's format; the first rule that selects a tensor gives its format, else the recipe's default.
Shapes that do not fit their format's block and gate/up pairs split across formats are refused;
what the recipe asks for but the plan does not do is kept as the plan's problems (`Plan.check`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mxrl.arch.names import TensorInfo, classify_tensors, gate_up_group, is_matmul_weight
from mxrl.formats.constants import FP8_BLOCK_WEIGHT, Format, block_along_k
from mxrl.recipe.plan import DEFAULT_RULE, NOT_MATMUL, Plan, TensorSpec
from mxrl.recipe.schema import Recipe, load_recipe

logger = logging.getLogger(__name__)


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
            specs.append(_spec(name, shape, info, Format.BF16, None, None, None, NOT_MATMUL, None))
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
            scale_mode = rule.scale_mode
        else:
            fmt, provenance, acts, block, fuse = recipe.default, DEFAULT_RULE, None, None, False
            scale_mode = None
            if fmt is Format.NVFP4:
                acts = "per_token"
            elif fmt is Format.FP8_BLOCK:
                block = FP8_BLOCK_WEIGHT
        group = gate_up_group(name, info) if fuse else None
        _check_block(name, shape, fmt, block, provenance)
        specs.append(_spec(name, shape, info, fmt, acts, group, block, provenance, scale_mode))
    _check_fuse_groups(specs)
    problems = _problems(recipe, provenances, selected, assigned, globbed, specs)
    plan = Plan(recipe.name, recipe.backward, num_layers, tuple(specs), problems, recipe.kv_cache)
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


def _spec(name, shape, info: TensorInfo, fmt, acts, group, block, rule, scale_mode) -> TensorSpec:
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
        scale_mode=scale_mode,
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
        if (a.format, a.activations, a.fuse_group, a.scale_mode) != (
            b.format,
            b.activations,
            b.fuse_group,
            b.scale_mode,
        ):
            raise ValueError(
                f"fuse: [gate, up] needs {a.name!r} and {b.name!r} in one format, but they "
                f"resolved to {_describe(a)} ({a.rule}) and {_describe(b)} ({b.rule}). Fix: give "
                "gate and up the same rule (match both names, or match by kind)"
            )


def _describe(s: TensorSpec) -> str:
    parts = [s.format.value]
    if s.scale_mode:
        parts.append(s.scale_mode)
    if s.activations:
        parts.append(s.activations)
    parts.append("fused" if s.fuse_group else "not fused")
    return " ".join(parts)
