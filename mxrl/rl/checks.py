"""The value checks of the train config's schema (`mxrl.rl.config`): each takes a field's path
and value and returns the value normalized, or raises ValueError naming the path, the value and
what is expected. Nothing here imports torch."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

Check = Callable[[str, Any], Any]  # (field path, value) -> the value normalized, or ValueError


def show(value: Any) -> str:
    kind = {str: "a string", bool: "a boolean", float: "a float", list: "a list"}
    return f"{value!r} ({kind[type(value)]})" if type(value) in kind else repr(value)


def integer(minimum: int, why: str = "") -> Check:
    def check(path: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"{path}: expected a whole number >= {minimum}, got {show(value)}; write it "
                "as digits, without quotes or a fraction"
            )
        if value < minimum:
            raise ValueError(f"{path}: must be >= {minimum}{why}, got {value}")
        return value

    return check


def number(low: float, high: float = math.inf, *, low_open: bool, high_open: bool = True,
           why: str = "") -> Check:  # fmt: skip
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    span = f"> {low:g}" if high == math.inf and low_open else f">= {low:g}"
    if high != math.inf:
        span = f"in {left}{low:g}, {high:g}{right}"

    def check(path: str, value: Any) -> float:
        if isinstance(value, str):
            try:
                float(value)
                hint = "; write it without quotes"
            except ValueError:
                hint = ""
            raise ValueError(f"{path}: expected a number {span}, got {show(value)}{hint}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: expected a number {span}, got {show(value)}")
        value = float(value)
        inside = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high
        )
        if not math.isfinite(value) or not inside:
            raise ValueError(f"{path}: must be a finite number {span}{why}, got {value!r}")
        return value

    return check


def choice(*values: Any, why: str = "") -> Check:
    def check(path: str, value: Any) -> Any:
        if isinstance(value, bool) or value not in values:
            shown = ", ".join("null" if v is None else str(v) for v in values)
            raise ValueError(f"{path}: must be one of {shown}{why}, got {show(value)}")
        return values[values.index(value)]  # the one allowed: an enum's member for its value

    return check


def text(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{path}: expected a non-empty string, got {show(value)}")
    return value


def optional_text(path: str, value: Any) -> str | None:
    return None if value is None else text(path, value)


def boolean(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{path}: expected true or false, got {show(value)}")
    return value
