"""Why the contract matters, measured: trainer-recomputed logprobs against the engine's.

With the engine storing bf16-format tensors in fp32 (the trainer's master dtype), a consistent
contract leaves only GEMM summation order between them (|dlogp| ~ 1e-7). An engine that breaks
the contract -- per-tensor instead of per-token NVFP4 activation scales -- is off by orders of
magnitude more. docs/mismatch.md has the full table (benchmarks/mismatch.py)."""

from __future__ import annotations

import random

import pytest
import torch

from mxrl.app.probe import measure_mismatch
from mxrl.arch import builtin_config
from mxrl.engine import Engine, SamplingParams
from mxrl.models import build_model
from mxrl.nn import apply_plan
from mxrl.recipe import resolve
from mxrl.rl import completion_logprobs
from mxrl.weights import export_weights

pytestmark = pytest.mark.capability  # holds on every CPU capability (tests/numeric_env.py)

BROKEN_NVFP4 = {  # nvfp4-dequantized with per-tensor activation scales: breaks the contract
    "name": "nvfp4-per-tensor-activations",
    "backward": "dequantized",
    "rules": [
        {"match": {"layers": "last 15%"}, "format": "bf16"},
        {"match": {"kind": "shared_expert"}, "format": "bf16"},
        {"match": {"kind": "router"}, "format": "bf16"},
        {
            "match": {"kind": "routed_expert"},
            "format": "nvfp4",
            "activations": "per_tensor",
            "fuse": ["gate", "up"],
        },
    ],
}


def _prompts(n=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 64) for _ in range(rng.randrange(3, 10))] for _ in range(n)]


def _measure(preset, engine_recipe=None, weight_dtype=torch.float32):
    trainer = build_model(builtin_config("tiny-moe"), seed=0)
    engine = Engine(trainer, engine_recipe or preset, weight_dtype=weight_dtype)
    apply_plan(trainer, resolve(preset, {n: p.shape for n, p in trainer.named_parameters()}))
    return measure_mismatch(trainer, engine, _prompts(), SamplingParams(max_new_tokens=16, seed=0))


@pytest.mark.parametrize("preset", ["bf16", "mxfp8", "nvfp4-dequantized"])
def test_consistent_contract_leaves_only_summation_order(preset):
    m = _measure(preset)
    assert m.num_tokens == 8 * 16
    assert m.logp_abs_diff_max < 1e-5 and m.k3 < 1e-10, m


@pytest.mark.parametrize("preset", ["bf16", "mxfp8", "nvfp4-dequantized"])
def test_bf16_storage_in_the_engine_costs_a_bounded_mismatch(preset):
    m = _measure(preset, weight_dtype=torch.bfloat16)
    assert 1e-6 < m.logp_abs_diff_mean < 2e-2, m


def test_breaking_the_contract_shows_a_larger_mismatch():
    consistent = _measure("nvfp4-dequantized")
    broken = _measure("nvfp4-dequantized", engine_recipe=BROKEN_NVFP4)
    assert broken.logp_abs_diff_mean > 100 * consistent.logp_abs_diff_mean
    assert broken.k3 > 100 * max(consistent.k3, 1e-12)


def test_the_plan_hash_catches_the_broken_engine_at_sync():
    """Live sync would have refused: the broken engine's plan has another hash."""
    trainer = build_model(builtin_config("tiny-moe"), seed=0)
    plan = resolve("nvfp4-dequantized", {n: p.shape for n, p in trainer.named_parameters()})
    engine = Engine(trainer, BROKEN_NVFP4)
    with pytest.raises(ValueError, match="plan hash mismatch"):
        engine.load_weights(export_weights(trainer.named_parameters(), plan), plan.hash())


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (5, 1.0), (8, 0.8)])
def test_sampling_filters_reach_the_trainer(top_k, top_p):
    """Rollouts with top-k / top-p: the trainer scores the same filtered distribution, so
    |dlogp| stays at the precision level; scored under the full distribution instead (what the
    trainer did before the filters reached it), the same tokens differ by the mass the filters
    removed."""
    trainer = build_model(builtin_config("tiny-moe"), seed=0)
    engine = Engine(trainer, "bf16", weight_dtype=torch.float32)
    apply_plan(trainer, resolve("bf16", {n: p.shape for n, p in trainer.named_parameters()}))
    params = SamplingParams(max_new_tokens=16, seed=0, top_k=top_k, top_p=top_p)
    outs = engine.generate(_prompts(), params)
    tokens = [o.tokens for o in outs]
    with torch.no_grad():
        same = completion_logprobs(trainer, _prompts(), tokens, params)
        full = completion_logprobs(trainer, _prompts(), tokens)
    rollout = torch.cat([o.logprobs for o in outs])
    assert (torch.cat(same) - rollout).abs().max() < 1e-5
    # the filters renormalise onto fewer tokens: every kept token's logprob rises
    assert (rollout - torch.cat(full)).min() > 1e-3
