"""The rollout engine refuses a deepseek_v3 model (MLA has no paged cache there, the sigmoid
router no rollout module: docs/models.md) with one error naming the family and what is missing,
on every way in, before it allocates anything; the Qwen families still build."""

from __future__ import annotations

import pytest

from mxrl.arch import ModelConfig
from mxrl.engine import Engine
from mxrl.models import build_model
from mxrl.recipe import resolve
from tests.models.deepseek_reference import CONFIGS

MESSAGE = r"model_type 'deepseek_v3': the rollout engine does not run this family yet: its MLA"


def test_engine_refuses_a_deepseek_model():
    model = build_model(CONFIGS["qlora-grouped-shared1"], seed=0)
    with pytest.raises(ValueError, match=MESSAGE) as err:
        Engine(model, "bf16")
    assert "kv_cache.py" in str(err.value) and "e_score_correction_bias" in str(err.value)


def test_engine_from_records_refuses_a_deepseek_config():
    config = ModelConfig.from_hf(CONFIGS["onegroup-nodense-k3"])
    model = build_model(config, seed=0)
    plan = resolve("bf16", {n: p.shape for n, p in model.named_parameters()})
    with pytest.raises(ValueError, match=MESSAGE):
        Engine.from_records(config, plan, [])
