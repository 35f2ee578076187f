"""A request past the model's max_position_embeddings is refused before anything runs: RoPE
would go on silently at positions the model was never trained on. The trainer's logprob path
checks the same lengths (for completions that did not come from the engine)."""

from __future__ import annotations

import pytest
import torch

from mxrl.arch import builtin_config
from mxrl.engine import Engine, SamplingParams
from mxrl.models import build_model
from mxrl.rl import completion_logprobs
from mxrl.rl.logprobs import sequence_logprobs
from tests.models.configs import CONFIGS

LIMIT = 128  # tests/models/configs.py: max_position_embeddings of every tiny HF config


@pytest.fixture(scope="module")
def engine():
    cfg = CONFIGS["qwen3_moe-norm-dense1"]
    assert cfg["max_position_embeddings"] == LIMIT
    return Engine(build_model(cfg, seed=0), "bf16")


def test_a_request_past_the_position_limit_is_refused(engine):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=9)
    prompts = [[1, 2, 3], [5] * 120]  # request 1: 120 + 9 = 129 > 128
    with pytest.raises(ValueError) as err:
        engine.generate(prompts, greedy)
    assert str(err.value) == (
        "request 1: the prompt's 120 tokens + max_new_tokens 9 = 129 tokens exceed the model's "
        "max_position_embeddings 128 (config.json); positions past it were never trained. "
        "Lower max_new_tokens to at most 8 or shorten the prompt"
    )
    too_long = [[5] * 130]
    with pytest.raises(ValueError, match="Shorten the prompt to fewer than 128 tokens"):
        engine.generate(too_long, greedy)
    # at the limit exactly: generated (a stop-free greedy run of 8 tokens)
    out = engine.generate([[5] * 120], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert len(out[0].tokens) == 8


def test_the_builtin_model_and_the_demo_fit_in_its_limit():
    """tiny-moe allows 256 positions; the demo's prompts (at most 7 tokens) and 4 new tokens
    are far inside."""
    from mxrl.app.demo import demo_task
    from mxrl.app.sources import TaskSource

    model = build_model(builtin_config("tiny-moe"), seed=0)
    assert model.config.max_positions == 256
    task = demo_task(0)
    prompts = TaskSource(task).next_batch(64).prompts
    assert max(len(p) for p in prompts) + task.max_new_tokens <= 256


def test_the_trainer_logprob_path_checks_the_same_lengths():
    model = build_model(CONFIGS["qwen3-tied"], seed=0)
    prompts, completions = [[1, 2], [3] * 100], [[4], [5] * 29]  # 100 + 29 = 129
    for fn in (completion_logprobs, sequence_logprobs):
        with pytest.raises(ValueError, match=r"sequence 1: .* = 129 tokens exceed .* 128"):
            fn(model, prompts, completions)
    logp = sequence_logprobs(model, [[3] * 100], [[5] * 28])  # 128: fits
    assert logp.shape == (1, 28) and torch.isfinite(logp).all()


def test_a_config_without_the_key_has_no_limit():
    cfg = {k: v for k, v in CONFIGS["qwen3-tied"].items() if k != "max_position_embeddings"}
    model = build_model(cfg, seed=0)
    assert model.config.max_positions is None
    model.config.check_positions(10_000, 10_000, "request 0", "max_new_tokens")  # no error
