"""The applications of the RL room: `mxrl train` (`train.py`, its checks in `preflight.py`),
`mxrl demo` (`demo.py`, `progress.py`), the SFT warm-up (`warmup.py`), the embedded task, prompt
datasets and reward functions (`task.py`, `data.py`, `rewards.py`, `sources.py`) and the
trainer-vs-rollout probe (`probe.py`); docs/rl.md.

The names below are imported on first use (PEP 562), as in `mxrl.rl`: `mxrl train` checks its
config before torch is imported."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "mxrl.app.data": ("PromptDataset", "PromptExample", "SkippedRow", "encode_prompt",
                      "render_prompt"),
    "mxrl.app.probe": ("measure_mismatch",),
    "mxrl.app.rewards": ("exact_match_reward", "integer_reward", "last_boxed", "load_reward",
                         "math_reward"),
    "mxrl.app.sources": ("DatasetSource", "TaskSource"),
    "mxrl.app.task": ("ArithmeticTask", "Problem", "SupervisedExample"),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'mxrl.app' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
