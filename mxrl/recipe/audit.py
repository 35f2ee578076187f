"""The audit table of a Plan: which tensor got which format, and which rule decided it.

Per-expert tensors collapse to one line per (layer, role) expert group —
`model.layers.0.mlp.experts.*.gate_proj.weight [x128]` — or, when a rule splits a group, one line
per part with the expert indices spelled out (`experts.{0-2,5}`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from mxrl.formats.constants import BITS_PER_ELEMENT, Format
from mxrl.recipe.schema import KVCacheFormat

if TYPE_CHECKING:
    from mxrl.recipe.plan import Plan, TensorSpec

_EXPERT_RE = re.compile(r"\.experts\.\d+\.")
_HEADER = ("name", "shape", "kind", "layer", "format", "rule")


def format_label(spec: TensorSpec) -> str:
    """`nvfp4 act=per_token fuse=gate+up`, `nvfp4 4over6 act=per_token`, `fp8_block 128x128`,
    `mxfp8`, `bf16`."""
    parts = [spec.format.value]
    if spec.scale_mode is not None:
        parts.append(spec.scale_mode)
    if spec.block is not None:
        parts.append(f"{spec.block[0]}x{spec.block[1]}")
    if spec.activations is not None:
        parts.append(f"act={spec.activations}")
    if spec.fuse_group is not None:
        parts.append("fuse=gate+up")
    return " ".join(parts)


def bits_per_element(spec: TensorSpec) -> float:
    """Stored bits per weight element, scales included (fp8_block depends on its block)."""
    if spec.format is Format.FP8_BLOCK and spec.block is not None:
        return 8.0 + 32.0 / (spec.block[0] * spec.block[1])
    return BITS_PER_ELEMENT[spec.format]


def _ranges(indices: Iterable[int]) -> str:
    xs = sorted(indices)
    parts, start = [], xs[0]
    for prev, cur in zip(xs, [*xs[1:], None], strict=True):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)


def _rows(plan: Plan) -> list[tuple[str, ...]]:
    # Group per-expert tensors by (layer, role); within a group, by everything the table shows.
    groups: dict[tuple, dict[tuple, list[TensorSpec]]] = {}
    order: list[tuple] = []
    for spec in plan.specs:
        if spec.expert is None:
            order.append(("single", spec.name))
            continue
        pattern = _EXPERT_RE.sub(".experts.*.", spec.name)
        key = ("experts", pattern)
        if key not in groups:
            groups[key] = {}
            order.append(key)
        look = (spec.shape, format_label(spec), spec.rule)
        groups[key].setdefault(look, []).append(spec)
    rows = []
    for key in order:
        if key[0] == "single":
            s = plan[key[1]]
            rows.append(_row(s.name, s))
            continue
        parts = groups[key]
        total = sum(len(v) for v in parts.values())
        for members in parts.values():
            head = members[0]
            if len(members) == total:
                name = key[1]
            else:
                name = key[1].replace(
                    ".experts.*.", f".experts.{{{_ranges(m.expert for m in members)}}}."
                )
            rows.append(_row(f"{name} [x{len(members)}]", head))
    return rows


def _row(name: str, s: TensorSpec) -> tuple[str, ...]:
    layer = "-" if s.layer is None else str(s.layer)
    shape = "[" + ", ".join(str(d) for d in s.shape) + "]"
    return (name, shape, s.kind.value, layer, format_label(s), s.rule)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _human_count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def format_summary(plan: Plan) -> str:
    """The per-format summary lines of the audit (tensors, parameters, bytes per format)."""
    return "\n".join(_summary(plan))


def _summary(plan: Plan) -> list[str]:
    per_format: dict[Format, list[float]] = {}
    bf16_bytes = 0.0
    for s in plan.specs:
        numel = 1
        for d in s.shape:
            numel *= d
        acc = per_format.setdefault(s.format, [0, 0, 0.0])
        acc[0] += 1
        acc[1] += numel
        acc[2] += numel * bits_per_element(s) / 8
        bf16_bytes += numel * BITS_PER_ELEMENT[Format.BF16] / 8
    kv = plan.kv_cache
    lines = [
        f"summary: recipe {plan.recipe_name}, backward {plan.backward.value}, "
        f"{plan.num_layers} layers"
        + (f", KV cache {kv.value}" if kv is not KVCacheFormat.COMPUTE else "")
    ]
    total_bytes = 0.0
    for fmt in Format:
        if fmt not in per_format:
            continue
        count, numel, nbytes = per_format[fmt]
        total_bytes += nbytes
        lines.append(
            f"  {fmt.value:<9} {int(count):>6} tensors {_human_count(int(numel)):>9} params "
            f"{_human_bytes(nbytes):>11}"
        )
    ratio = total_bytes / bf16_bytes if bf16_bytes else 1.0
    lines.append(
        f"  {'total':<9} {len(plan):>6} tensors; {_human_bytes(total_bytes)} vs "
        f"{_human_bytes(bf16_bytes)} all-bf16 ({ratio:.1%})"
    )
    return lines


def format_table(plan: Plan) -> str:
    """The audit table and summary of `plan` as one string."""
    rows = [_HEADER, *_rows(plan)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([*lines, "", *_summary(plan)])
