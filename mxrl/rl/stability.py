"""Training stability: gradient-norm spike detection and per-layer gradient norms (docs/design.md §8;
the seed articles report occasional NVFP4 gradient spikes, which this names and optionally skips).

Spike rule, on x = log(grad_norm) against the last `window` finite values:
  z = (x - median) / max(1.4826 * MAD, min_scale),   MAD = median(|x_i - median|)
1.4826 * MAD is the robust estimate of a normal distribution's standard deviation, so z reads
like a z-score, but one outlier in the window moves neither the median nor the MAD (a mean and
std would be dragged by the very spikes we look for). The log makes the rule scale free: a
norm that grows 100x is the same spike whether norms sit at 1e-3 or 1e3. `min_scale` (log
units) floors the scale, so a perfectly steady history (MAD = 0) does not turn a 1% wobble into
a spike: with the defaults a jump needs exp(6 * 0.05) = 1.35x over the median at least.
A step is a spike when z > z_threshold (upward only: a falling norm is not a danger) once
`min_history` values are known. A non-finite norm (NaN, Inf) is always a spike and always
skipped, whatever the action: an optimizer step on NaN gradients would write NaN into every
weight. Every finite norm, spike or not, joins the history, so a lasting change of regime
(after a learning-rate change, say) becomes the new normal after about window/2 steps instead
of being skipped forever.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from mxrl.rl.choices import SpikeAction

_MAD_TO_STD = 1.4826  # 1 / Phi^-1(3/4): MAD -> standard deviation for normal data
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class SpikeDecision:
    """spike: this step's gradient norm is an outlier (or non-finite); z: its robust z-score
    (0 before min_history, inf for a non-finite norm); skip: the caller should drop this
    optimizer step (action "skip", or a non-finite norm)."""

    spike: bool
    z: float
    skip: bool

    def as_dict(self, prefix: str = "grad/") -> dict[str, float]:
        return {
            f"{prefix}spike": float(self.spike),
            f"{prefix}z": self.z,
            f"{prefix}skipped": float(self.skip),
        }


class GradSpikeDetector:
    """Robust z-score of log(grad_norm) over a sliding window (rule in the module docstring).

    Use: `d = detector.update(total_norm)` after clipping has measured the norm and before the
    optimizer step; if d.skip, zero the gradients instead of stepping; if d.spike, log the
    event with `top_growth(layer_grad_norms(model), previous)`.
    """

    def __init__(
        self,
        window: int = 50,
        z_threshold: float = 6.0,
        min_history: int = 10,
        action: SpikeAction = SpikeAction.LOG,
        min_scale: float = 0.05,
    ) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not 1 <= min_history <= window:
            raise ValueError(f"min_history must be in [1, window={window}], got {min_history}")
        if z_threshold <= 0:
            raise ValueError(f"z_threshold must be > 0, got {z_threshold}")
        if action not in tuple(SpikeAction):
            raise ValueError(f"action must be 'log' or 'skip', got {action!r}")
        if min_scale <= 0:
            raise ValueError(f"min_scale must be > 0 (log units), got {min_scale}")
        self.window = window
        self.z_threshold = z_threshold
        self.min_history = min_history
        self.action = SpikeAction(action)
        self.min_scale = min_scale
        self._history: deque[float] = deque(maxlen=window)
        self.num_updates = 0
        self.num_spikes = 0
        self.num_skipped = 0

    def update(self, grad_norm: float | torch.Tensor) -> SpikeDecision:
        g = float(grad_norm)
        self.num_updates += 1
        if not math.isfinite(g):
            self.num_spikes += 1
            self.num_skipped += 1
            return SpikeDecision(spike=True, z=math.inf, skip=True)
        x = math.log(max(g, 1e-30))
        z = 0.0
        if len(self._history) >= self.min_history:
            med = statistics.median(self._history)
            mad = statistics.median(abs(v - med) for v in self._history)
            z = (x - med) / max(_MAD_TO_STD * mad, self.min_scale)
        self._history.append(x)
        spike = z > self.z_threshold
        skip = spike and self.action == SpikeAction.SKIP
        self.num_spikes += spike
        self.num_skipped += skip
        return SpikeDecision(spike=spike, z=z, skip=skip)

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "history": list(self._history),
            "num_updates": self.num_updates,
            "num_spikes": self.num_spikes,
            "num_skipped": self.num_skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"history", "num_updates", "num_spikes", "num_skipped"} - set(state)
        if missing:
            raise ValueError(f"GradSpikeDetector state lacks {sorted(missing)}")
        history = [float(v) for v in state["history"]]
        if len(history) > self.window:
            history = history[-self.window :]  # resumed with a smaller window: keep the newest
        self._history = deque(history, maxlen=self.window)
        self.num_updates = int(state["num_updates"])
        self.num_spikes = int(state["num_spikes"])
        self.num_skipped = int(state["num_skipped"])


def layer_grad_norms(model: torch.nn.Module, ranks: Any = None) -> dict[str, float]:
    """L2 norm of the gradients per group of parameters: "layer.{i}" (everything under
    `layers.{i}.`), "embed" (embed_tokens), "lm_head", "norm" (the final norm) and "other"
    (anything else). Parameters without a gradient are left out; a group with none is absent.
    One device sync for the whole model.

    ranks: the train ranks (`mxrl.rl.actor.TrainRanks`) when the gradients are sharded: each
    rank squares and sums its own shards (the same ops), and `ranks.sum` adds them up. With one
    rank (or None) nothing is reduced."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach()
        # a DTensor (FSDP2) gives this rank's shard; duck-typed, so that one process does not
        # import torch.distributed.tensor (seconds at start-up)
        g = g.to_local() if hasattr(g, "to_local") else g
        groups.setdefault(layer_group(name), []).append(g.float().pow(2).sum())
    if not groups:
        return {}
    names = list(groups)  # parameter order: the same on every rank (FSDP2 grads all or none)
    sq = torch.stack([torch.stack(groups[n]).sum() for n in names])
    if ranks is not None and ranks.size > 1:
        sq = ranks.sum(sq)
    # math.sqrt is the correctly rounded IEEE root; torch.sqrt on the CPU is MKL's, which rounds
    # differently by processor (mxrl/rl/optim.py)
    return {n: math.sqrt(v) for n, v in zip(names, sq.tolist(), strict=True)}


def layer_group(name: str) -> str:
    """The group of `layer_grad_norms` a parameter name falls in."""
    hit = _LAYER.search(name)
    if hit:
        return f"layer.{int(hit.group(1))}"
    if "embed" in name:
        return "embed"
    if "lm_head" in name:
        return "lm_head"
    if re.search(r"(?:^|\.)norm\.", name):
        return "norm"
    return "other"


def top_growth(
    current: dict[str, float], previous: dict[str, float], k: int = 5
) -> list[tuple[str, float]]:
    """The k groups whose gradient norm grew most from `previous` to `current`, as
    (name, current / previous), largest first. A non-finite current norm, or growth from 0,
    counts as inf; a group absent from `previous` is left out."""
    growth = []
    for name, cur in current.items():
        if name not in previous:
            continue
        prev = previous[name]
        if not math.isfinite(cur) or (prev <= 0 and cur > 0):
            ratio = math.inf
        elif prev <= 0:
            ratio = 1.0  # 0 -> 0
        else:
            ratio = cur / prev
        growth.append((name, ratio))
    growth.sort(key=lambda item: item[1], reverse=True)
    return growth[:k]
