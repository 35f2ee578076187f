"""The RL math and the one trainer: GRPO advantages and the clipped policy loss with TIS/MIS,
mismatch and stability metrics, trainer-side logprobs (docs/rl.md, docs/mismatch.md); the
applications that use them (train, demo, warm-up, task, datasets, rewards, the mismatch probe)
are in `mxrl.app`.

The names below are imported on first use (PEP 562), so that `mxrl.rl.config` — the train
config's schema, checked before any work — loads without torch and a config error is reported
at once."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "mxrl.rl.grpo": ("group_advantages", "policy_loss", "zero_std_groups"),
    "mxrl.rl.logprobs": ("completion_logprobs",),
    "mxrl.rl.mismatch": ("MismatchMetrics", "mismatch_metrics"),
    "mxrl.rl.stability": ("GradSpikeDetector", "SpikeDecision", "layer_grad_norms",
                          "top_growth"),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'mxrl.rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
