"""The `layers` selector: "5", "0-3", "0-3,10", "first 2", "last 2", "first 10%", "last 15%".

Percentages count layers conservatively: count = ceil(p/100 * num_layers), computed in exact
rational arithmetic. "last 15%" of 48 layers is 8 layers (40..47), of 4 layers 1 layer (3): a
percentage never rounds down to fewer layers, so a "keep the last p% in bf16" rule keeps at least
p% of the model in high precision. Items may be combined with commas ("first 1, last 15%").
Indices beyond the model's last layer select nothing (a recipe is portable across model depths).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

_RANGE_RE = re.compile(r"(\d+)\s*-\s*(\d+)")
_INDEX_RE = re.compile(r"\d+")
_EDGE_RE = re.compile(r"(first|last)\s+(\d+(?:\.\d+)?)\s*(%?)")

LAYERS_SYNTAX = (
    'an index "5", an inclusive range "0-3", "first N", "last N", "first P%", "last P%", '
    'or a comma list of those ("0-3,10")'
)


@dataclass(frozen=True)
class LayerSelector:
    """A parsed `layers` selector; `indices(num_layers)` gives the selected layer indices."""

    text: str

    def __post_init__(self) -> None:
        # Parse once here so a malformed selector fails when the recipe is loaded.
        self._items()

    def _items(self) -> list[tuple[str, Fraction | int, int | None]]:
        items: list[tuple[str, Fraction | int, int | None]] = []
        parts = [p.strip() for p in str(self.text).split(",")]
        if not any(parts):
            raise ValueError(f"layers: empty selector; use {LAYERS_SYNTAX}")
        for part in parts:
            if m := _RANGE_RE.fullmatch(part):
                lo, hi = int(m.group(1)), int(m.group(2))
                if lo > hi:
                    raise ValueError(
                        f"layers: range {part!r} runs backwards; write it as '{hi}-{lo}'"
                    )
                items.append(("range", lo, hi))
            elif _INDEX_RE.fullmatch(part):
                items.append(("range", int(part), int(part)))
            elif m := _EDGE_RE.fullmatch(part):
                edge, amount, percent = m.group(1), Fraction(m.group(2)), m.group(3)
                if percent:
                    if amount > 100:
                        raise ValueError(f"layers: {part!r} asks for more than 100% of the layers")
                    items.append((f"{edge}%", amount, None))
                else:
                    if amount.denominator != 1:
                        raise ValueError(
                            f"layers: {part!r} needs a whole number of layers (or add '%')"
                        )
                    items.append((edge, int(amount), None))
            else:
                raise ValueError(f"layers: cannot parse {part!r}; use {LAYERS_SYNTAX}")
        return items

    def indices(self, num_layers: int) -> frozenset[int]:
        """The selected layer indices of a model with `num_layers` decoder layers."""
        selected: set[int] = set()
        for how, a, b in self._items():
            if how == "range":
                assert b is not None
                selected.update(range(int(a), min(b, num_layers - 1) + 1))
                continue
            if how.endswith("%"):
                exact = Fraction(a) * num_layers / 100
                count = -(-exact.numerator // exact.denominator)  # ceil, exact
            else:
                count = int(a)
            count = min(count, num_layers)
            if how.startswith("first"):
                selected.update(range(count))
            else:
                selected.update(range(num_layers - count, num_layers))
        return frozenset(selected)


def parse_layers(value: object) -> LayerSelector:
    """A LayerSelector from a YAML value: a string, or a non-negative integer index."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"layers: expected a string ({LAYERS_SYNTAX}), got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"layers: layer indices are >= 0, got {value}")
    return LayerSelector(str(value).strip())
