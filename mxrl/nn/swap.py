"""swap_modules: the one walk that replaces a model's modules by rule, in place. `apply_plan`
(mxrl.nn.apply) swaps the trainer's modules with it, `Engine` (mxrl.engine) the rollout ones.

The walk visits the model's modules as they were before it (`named_modules` order). A module is
matched against the rules in order and the first rule of its kind decides: its `make` gives the
new module and the plan tensors it holds, or None to keep the module (or raises: a check).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from mxrl.recipe import TensorSpec


@dataclass(frozen=True)
class Swap:
    """One module replaced (the audit): its name, the new module's type, the plan tensors the
    new module holds and their formats."""

    module: str
    new_type: str
    tensors: tuple[str, ...]
    formats: tuple[str, ...]


Replacement = tuple[nn.Module, Sequence[TensorSpec]]


@dataclass(frozen=True)
class SwapRule:
    """Modules of type `kind` are replaced by `make(name, module)`: (the new module, the plan
    tensors it holds), or None to keep the module."""

    kind: type[nn.Module] | tuple[type[nn.Module], ...]
    make: Callable[[str, nn.Module], Replacement | None]


def swap_modules(model: nn.Module, rules: Sequence[SwapRule]) -> list[Swap]:
    """Replace `model`'s modules as `rules` say (module docstring); returns what was swapped,
    in walk order."""
    swaps: list[Swap] = []
    for name, module in list(model.named_modules()):
        rule = next((r for r in rules if isinstance(module, r.kind)), None)
        made = None if rule is None else rule.make(name, module)
        if made is None:
            continue
        new, specs = made
        _replace(model, name, new)
        formats = tuple(s.format for s in specs)
        swaps.append(Swap(name, type(new).__name__, tuple(s.name for s in specs), formats))
    return swaps


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
