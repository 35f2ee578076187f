"""Reward functions: `reward(response_text, label) -> float`, and `load_reward` to pick one by
name or by import path.

math_reward is the verifiable math reward of dapo-math-17k-style training (verl `math_verify`,
TRL `accuracy_reward`, NeMo-RL's math env; rl_frameworks.md §1 "Shipped reward fns"): the
answer is the content of the response's LAST \\boxed{...}, compared with the label by
math-verify (numeric and symbolic equivalence, so 0.5, 1/2 and \\frac{1}{2} agree).
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, Any], float]

_BOXED = re.compile(r"\\(?:boxed|fbox)")
# math-verify's timeouts use SIGALRM, which only the main thread may install.
_TIMEOUT_S = 5


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) of `text`, nested braces matched,
    escaped braces (\\{ \\}) taken as characters; `\\boxed 5` (no braces) gives the next token.
    None when there is none or the last one is not closed (a truncated response)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i = starts[-1]
    if i < len(text) and text[i] == " ":
        rest = text[i:].split()
        token = rest[0].rstrip("$.") if rest else ""
        return token or None
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


def math_reward(response: str, label: Any) -> float:
    """1.0 when the last \\boxed{} answer of `response` is equivalent to `label` under
    math-verify, else 0.0 (no boxed answer, unparsable text, any error: never raises).

    The label is parsed as LaTeX math: wrapped in $...$ unless it already holds $ or \\boxed
    (a bare `x^2+1` or `\\sqrt{2}` is not found by math-verify otherwise)."""
    try:
        from math_verify import parse, verify

        answer = last_boxed(str(response))
        if answer is None or not answer.strip():
            return 0.0
        gold_text = str(label).strip()
        if not gold_text:
            return 0.0
        if "$" not in gold_text and "\\boxed" not in gold_text:
            gold_text = f"${gold_text}$"
        timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
        gold = parse(gold_text, parsing_timeout=timeout)
        pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
        if not gold or not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
    except Exception as err:  # math-verify on adversarial text: score 0, never stop training
        logger.debug("math_reward: %s on response %.80r", err, response)
        return 0.0


def exact_match_reward(response: str, label: Any) -> float:
    """1.0 when the response equals the label after stripping surrounding whitespace."""
    return 1.0 if str(response).strip() == str(label).strip() else 0.0


_INT_PREFIX = re.compile(r"[+-]?\d+")


def leading_integer(text: str) -> int | None:
    """The integer the text starts with: an optional sign then digits, up to the first other
    character (or an `<eos>` marker left by decoding with specials); None when there is none."""
    text = str(text).split("<eos>", 1)[0]
    m = _INT_PREFIX.match(text)
    return int(m.group()) if m else None


def integer_reward(response: str, label: Any) -> float:
    """1.0 when the response starts with exactly the integer `label` (the embedded arithmetic
    task's rule: `leading_integer`), else 0.0."""
    got = leading_integer(response)
    try:
        want = int(str(label).strip())
    except ValueError:
        return 0.0
    return 1.0 if got is not None and got == want else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "exact_match": exact_match_reward,
    "integer": integer_reward,
}


def load_reward(name: str) -> RewardFn:
    """A built-in reward ("math", "exact_match", "integer") or a user function given as
    "package.module:function" or "package.module.function" (imported; must be callable as
    fn(response_text, label) -> float). ValueError naming the path when it cannot be loaded."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
    else:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"unknown reward {name!r}: use one of {sorted(BUILTIN_REWARDS)} or an import path "
            "like 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r} ({err})") from err
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {module_name}.{attr} is not callable")
    return fn
