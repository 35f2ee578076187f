"""The module-swap audit: what was replaced, by what, holding which plan tensors."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Swap:
    """One module replaced by apply_plan (the audit)."""

    module: str
    new_type: str
    tensors: tuple[str, ...]
    formats: tuple[str, ...]
