"""Train-rollout mismatch metrics (docs/design.md §8), computed every step, correction on or off.

With log-ratio d = logp_train - logp_rollout on the sampled tokens (samples drawn from the
rollout policy), the estimators of KL(rollout || train) are
  k1 = E[-d]                 (unbiased, can be negative)
  k3 = E[exp(d) - 1 - d]     (unbiased, always >= 0; Schulman's estimator)
Per sequence: means over that sequence's valid tokens. Per batch: means over all valid tokens
of the batch (token-level, as the loss aggregates), and the max |d|.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MismatchMetrics:
    """Batch-level numbers (floats) and per-sequence tensors [B] (NaN for an empty sequence)."""

    k1: float
    k3: float
    logp_abs_diff_mean: float
    logp_abs_diff_max: float
    num_tokens: int
    seq_k1: torch.Tensor
    seq_k3: torch.Tensor
    seq_abs_diff_mean: torch.Tensor
    seq_abs_diff_max: torch.Tensor

    def as_dict(self, prefix: str = "mismatch/") -> dict[str, float]:
        """The batch numbers under the run-record keys (mismatch/k1, mismatch/k3, ...)."""
        return {
            f"{prefix}k1": self.k1,
            f"{prefix}k3": self.k3,
            f"{prefix}logp_abs_diff_mean": self.logp_abs_diff_mean,
            f"{prefix}logp_abs_diff_max": self.logp_abs_diff_max,
        }


def mismatch_metrics(
    rollout_logp: torch.Tensor, train_logp: torch.Tensor, mask: torch.Tensor
) -> MismatchMetrics:
    """rollout_logp, train_logp, mask: [B, T] (padded; mask 1/True on response tokens)."""
    if rollout_logp.shape != train_logp.shape or rollout_logp.shape != mask.shape:
        raise ValueError(
            f"shapes differ: rollout {tuple(rollout_logp.shape)}, train "
            f"{tuple(train_logp.shape)}, mask {tuple(mask.shape)}; pad all three to [B, T]"
        )
    m = mask.to(torch.bool)
    d = (train_logp.double() - rollout_logp.double()).masked_fill(~m, 0.0)
    k1 = (-d).masked_fill(~m, 0.0)
    k3 = (torch.expm1(d) - d).masked_fill(~m, 0.0)
    absd = d.abs()
    n_seq = m.sum(-1)
    n = int(n_seq.sum())
    denom = n_seq.clamp(min=1).double()
    empty = n_seq == 0
    nan = torch.tensor(float("nan"), dtype=torch.float64)

    def per_seq(x: torch.Tensor) -> torch.Tensor:
        return torch.where(empty, nan, x.sum(-1) / denom).float()

    seq_max = torch.where(empty, nan, absd.masked_fill(~m, 0.0).amax(-1)).float()
    return MismatchMetrics(
        k1=float(k1.sum() / max(n, 1)),
        k3=float(k3.sum() / max(n, 1)),
        logp_abs_diff_mean=float(absd.sum() / max(n, 1)),
        logp_abs_diff_max=float(absd.max()) if n else 0.0,
        num_tokens=n,
        seq_k1=per_seq(k1),
        seq_k3=per_seq(k3),
        seq_abs_diff_mean=per_seq(absd),
        seq_abs_diff_max=seq_max,
    )
