"""RL building blocks: GRPO advantages and the clipped policy loss with TIS/MIS, mismatch and
stability metrics, prompt datasets, rewards, the embedded arithmetic task, trainer-side
logprobs and the trainer-vs-rollout probe (docs/rl.md, docs/mismatch.md)."""

from mxrl.rl.data import PromptDataset, PromptExample, SkippedRow, encode_prompt, render_prompt
from mxrl.rl.grpo import group_advantages, policy_loss, zero_std_groups
from mxrl.rl.logprobs import completion_logprobs
from mxrl.rl.mismatch import MismatchMetrics, mismatch_metrics
from mxrl.rl.probe import measure_mismatch
from mxrl.rl.rewards import (
    exact_match_reward,
    integer_reward,
    last_boxed,
    load_reward,
    math_reward,
)
from mxrl.rl.stability import GradSpikeDetector, SpikeDecision, layer_grad_norms, top_growth
from mxrl.rl.task import ArithmeticTask, Problem, SupervisedExample

__all__ = [
    "ArithmeticTask",
    "GradSpikeDetector",
    "MismatchMetrics",
    "Problem",
    "PromptDataset",
    "PromptExample",
    "SkippedRow",
    "SpikeDecision",
    "SupervisedExample",
    "completion_logprobs",
    "encode_prompt",
    "exact_match_reward",
    "group_advantages",
    "integer_reward",
    "last_boxed",
    "layer_grad_norms",
    "load_reward",
    "math_reward",
    "measure_mismatch",
    "mismatch_metrics",
    "policy_loss",
    "render_prompt",
    "top_growth",
    "zero_std_groups",
]
