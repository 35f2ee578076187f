"""The rollout engine on deepseek_v3 (MLA with its expanded keys and values in the paged cache,
the sigmoid router tiled in fp32): the trainer's logprobs up to summation order under every
engine kind, with and without routing replay; batch invariance byte for byte (tokens, logprobs,
routed experts); e_score_correction_bias held in fp32 whatever the engine's weight dtype; the
cache's shapes; a quantized router refused by name."""

from __future__ import annotations

import random

import pytest
import torch

from mxrl.app.probe import measure_mismatch
from mxrl.engine import Engine, SamplingParams
from mxrl.models import build_model
from mxrl.nn import apply_plan
from mxrl.recipe import resolve
from tests.models.deepseek_reference import CONFIGS
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

PROMPTS = [[5, 9, 2, 7, 1, 33, 12], [3, 4], [60, 61, 62, 63, 1], [8] * 11]


def _trainer(name: str | dict, seed: int = 0):
    """A tiny DeepSeek-V3 (a name of CONFIGS, or a config) with a random router bias."""
    model = build_model(CONFIGS[name] if isinstance(name, str) else name, seed=seed)
    with torch.no_grad():  # a bias that moves choices (init_weights zeroes it)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(
                    0.0, 0.05, generator=torch.Generator().manual_seed(1)
                )
    return model


def _prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 64) for _ in range(rng.randrange(3, 10))] for _ in range(n)]


@pytest.mark.parametrize("preset", ["bf16", "mxfp8", "nvfp4-dequantized"])
@pytest.mark.parametrize("name", ["qlora-grouped-shared1", "yarn-mscale"])
@pytest.mark.parametrize("replay", [False, True])
def test_engine_logprobs_are_the_trainers(preset, name, replay):
    trainer = _trainer(name)
    engine = Engine(trainer, preset, weight_dtype=torch.float32)
    apply_plan(trainer, resolve(preset, {n: p.shape for n, p in trainer.named_parameters()}))
    params = SamplingParams(max_new_tokens=12, seed=0)
    m = measure_mismatch(trainer, engine, _prompts(), params, replay_routing=replay)
    assert m.num_tokens == 6 * 12
    assert m.logp_abs_diff_max < 1e-5 and m.k3 < 1e-10, m


@pytest.mark.parametrize("preset", ["bf16", "mxfp8"])
@pytest.mark.parametrize("name", ["qlora-grouped-shared1", "noqlora-bias-shared2-dense2"])
def test_batch_invariance(preset, name):
    engine = Engine(_trainer(name), preset, tile=8)
    params = [SamplingParams(temperature=1.0, max_new_tokens=10, seed=100 + i) for i in range(4)]
    batch = engine.generate(PROMPTS, params)
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], [params[i]])[0]
        assert alone.tokens == batch[i].tokens, f"request {i}"
        assert_bytes_equal(alone.logprobs, batch[i].logprobs, f"request {i} logprobs")
        assert_bytes_equal(alone.routed_experts, batch[i].routed_experts, f"request {i} routing")


def test_router_bias_stays_fp32_and_the_cache_holds_expanded_heads():
    cfg = CONFIGS["qlora-grouped-shared1"]
    trainer = _trainer("qlora-grouped-shared1")
    engine = Engine(trainer, "bf16", weight_dtype=torch.bfloat16)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    held = engine.net.get_submodule("model.layers.1.mlp.gate").e_score_correction_bias
    assert held.dtype == torch.float32
    assert torch.equal(held, trainer.get_parameter(name).detach())
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))
    heads = cfg["num_attention_heads"]
    k_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    assert engine._kv.k[0].shape[2:] == (heads, k_dim)
    assert engine._kv.v[0].shape[2:] == (heads, cfg["v_head_dim"])


def test_a_quantized_router_is_refused_by_the_engine():
    trainer = _trainer("qlora-grouped-shared1")
    recipe = {"name": "router-fp8", "rules": [{"match": {"kind": "router"}, "format": "mxfp8"}]}
    plan = resolve(recipe, {n: p.shape for n, p in trainer.named_parameters()})
    with pytest.raises(ValueError, match=r"mlp\.gate\.weight is mxfp8 in the plan; the sigmoid"):
        Engine(trainer, plan)
