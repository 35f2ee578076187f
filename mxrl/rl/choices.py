"""The closed sets of the RL settings, as enums: the loss's rollout correction and aggregation
(`mxrl.rl.grpo`), the spike detector's action (`mxrl.rl.stability`), the run's compute dtype.

Each is a `StrEnum` whose values are the YAML spellings, so `Correction("tis") ==
"tis"` and a config or checkpoint that holds the string reads the same as one that holds the
member. They live here, without torch, so that the train config's schema (`mxrl.rl.config`)
types its fields by them before torch is loaded.
"""

from __future__ import annotations

from enum import StrEnum


class Correction(StrEnum):
    """Rollout correction of the policy loss (docs/rl.md, "Rollout correction")."""

    TIS = "tis"  # token truncated importance sampling: w = min(rho, tis_cap)
    MIS = "mis"  # token masked importance sampling: tokens with rho outside the bounds dropped


class Aggregation(StrEnum):
    """How the policy loss averages its tokens (docs/rl.md, "Aggregation")."""

    TOKEN_MEAN = "token-mean"  # DAPO, verl's default
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"  # original GRPO


class SpikeAction(StrEnum):
    """What a gradient-norm spike does (a non-finite norm always skips)."""

    LOG = "log"
    SKIP = "skip"  # the optimizer step is dropped


class ComputeDtype(StrEnum):
    """The engine's compute dtype and the training forward's autocast."""

    AUTO = "auto"  # bfloat16 on CUDA, float32 on the CPU
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
