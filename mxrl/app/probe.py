"""Trainer-vs-rollout agreement probe: sample with the engine, recompute the logprobs with the
trainer's model, compare (the step-0 check of the RL loop, and docs/mismatch.md's table)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from mxrl.engine import Engine, SamplingParams
from mxrl.models import CausalLM
from mxrl.rl.logprobs import completion_logprobs
from mxrl.rl.mismatch import MismatchMetrics, mismatch_metrics


@torch.no_grad()
def measure_mismatch(
    trainer: CausalLM,
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    replay_routing: bool = False,
) -> MismatchMetrics:
    """Generate with `engine`, score the same tokens with `trainer` (plan already applied),
    return the mismatch metrics over all generated tokens."""
    outs = engine.generate(prompts, params)
    replay = [o.routed_experts for o in outs] if replay_routing else None
    train = completion_logprobs(trainer, prompts, [o.tokens for o in outs], params,
                                replay_routing=replay)  # fmt: skip
    rollout = pad_sequence([o.logprobs for o in outs], batch_first=True)
    trained = pad_sequence(train, batch_first=True)
    mask = pad_sequence([torch.ones(len(o.tokens)) for o in outs], batch_first=True)
    return mismatch_metrics(rollout, trained, mask)
