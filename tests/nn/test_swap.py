"""swap_modules, the one module walker of apply_plan and the engine: the first rule of a
module's kind decides, None keeps the module, the walk is over the modules as they were."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from mxrl.nn.swap import Swap, SwapRule, swap_modules


def spec(name, fmt="mxfp8"):
    return SimpleNamespace(name=name, format=fmt)


def test_first_rule_of_a_kind_decides_and_none_keeps():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2)))
    seen = []

    def linear(name, module):
        seen.append(name)
        return (nn.Identity(), (spec(f"{name}.weight"),)) if name == "0" else None

    def never(name, module):
        raise AssertionError(f"{name}: a later rule of the same kind was tried")

    tanh = SwapRule((nn.ReLU,), lambda name, module: (nn.Tanh(), ()))
    rules = [SwapRule(nn.Linear, linear), tanh, SwapRule(nn.Linear, never)]
    swaps = swap_modules(model, rules)
    assert seen == ["0", "2.0"]
    assert type(model[0]) is nn.Identity and type(model[1]) is nn.Tanh
    assert type(model[2][0]) is nn.Linear  # make gave None: kept
    assert swaps == [Swap("0", "Identity", ("0.weight",), ("mxfp8",)), Swap("1", "Tanh", (), ())]


def test_the_walk_is_over_the_modules_as_they_were():
    model = nn.Sequential(nn.Linear(2, 2))
    # a rule whose replacement is itself of a swapped kind is not applied to it again
    swaps = swap_modules(model, [SwapRule(nn.Linear, lambda n, m: (nn.Linear(2, 2), ()))])
    assert [s.module for s in swaps] == ["0"]
