"""RL: mismatch metrics, trainer-side logprobs and the trainer-vs-rollout probe (the GRPO loop
lands with the RL issue)."""

from mxrl.rl.logprobs import completion_logprobs
from mxrl.rl.mismatch import MismatchMetrics, mismatch_metrics
from mxrl.rl.probe import measure_mismatch

__all__ = ["MismatchMetrics", "completion_logprobs", "measure_mismatch", "mismatch_metrics"]
