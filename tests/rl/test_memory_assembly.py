"""The memory estimate's assembly (mxrl/rl/memory.py `_estimate`): its terms replaced by
recording stand-ins, so which term gets what, and what the estimate does with each result, is
checked against sums written by hand. The terms themselves: tests/rl/test_memory.py."""

from __future__ import annotations

import math

import pytest

from mxrl.arch import ModelConfig, tensors_from_hf_config
from mxrl.recipe import resolve
from mxrl.rl import memory
from mxrl.rl.config import TrainConfig
from tests.rl.test_memory import HAND, _hf


class _Terms:
    """Stand-ins for mxrl.rl.memory_terms that record their arguments and return values fixed
    here, so the estimate's assembly (which term gets what, and what it does with the result)
    is checked against sums written by hand."""

    def __init__(self, monkeypatch, per_token=(700, 300), ckpt=(70, 30)):
        self.calls: dict[str, list[tuple]] = {}
        self.per_token, self.ckpt = per_token, ckpt
        for name in ("activation_bytes", "engine_weight_bytes", "kv_cache_bytes"):
            monkeypatch.setattr(memory, name, self._recorder(name))
        monkeypatch.setattr(memory, "logits_chunk_bytes", self._recorder("logits_chunk_bytes"))
        monkeypatch.setattr(memory, "train_copy_bytes", self._recorder("train_copy_bytes"))

    def _recorder(self, name):
        def record(*args):
            self.calls.setdefault(name, []).append(
                args[1:] if name != "logits_chunk_bytes" else args
            )
            if name == "activation_bytes":
                return self.ckpt if args[5] is True else self.per_token
            if name == "train_copy_bytes":
                return 1001 if len(args) > 5 and args[5] else 500
            return {"engine_weight_bytes": 9000, "kv_cache_bytes": 8000}.get(name, 7)

        return record


def _plan_and_cfg(rl: dict, placement: dict | None = None, kv_fp8: bool = False):
    recipe = {"name": "r", "default": "bf16", "rules": []}
    if kv_fp8:
        recipe["kv_cache"] = "fp8"
    raw = {"model": "x", "rl": {**rl, "recipe": recipe}}
    if placement:
        raw["placement"] = placement
    cfg = TrainConfig.from_dict(raw)
    hf = _hf(**HAND)
    return ModelConfig.from_hf(hf), resolve(cfg.rl.recipe, tensors_from_hf_config(hf, "fused")), cfg


@pytest.mark.parametrize(
    ("device", "compute", "engine"),
    [
        ("cuda", "auto", 2), ("cpu", "auto", 4), ("cuda", "bfloat16", 2), ("cpu", "bfloat16", 2),
        ("cuda", "float32", 4), ("cpu", "float32", 4),
    ],
)  # fmt: skip
def test_each_term_gets_the_dtypes_and_flags_of_the_config(monkeypatch, device, compute, engine):
    """The engine's bytes per value: 2 under bf16 compute, or auto on CUDA; 4 otherwise. The
    training ops compute in the smaller of the engine's and the master's (fp32 here). Each term
    is asked with this config's own flags, the checkpointed activations with checkpointing."""
    terms = _Terms(monkeypatch)
    model_cfg, plan, cfg = _plan_and_cfg({"device": device, "compute_dtype": compute})
    est = memory.estimate_memory(model_cfg, plan, cfg, prompt_tokens=8, capacity=None)
    cuda, seq = device == "cuda", 8 + cfg.rl.max_new_tokens
    assert terms.calls["activation_bytes"] == [
        (4, engine, cuda, seq, False, {}),  # bf16 experts keep bf16 rows: nothing to narrow
        (4, engine, cuda, seq, True, {}),
    ]
    assert terms.calls["engine_weight_bytes"] == [(engine, cuda)]
    kv_args = terms.calls["kv_cache_bytes"][0]
    assert kv_args[2:] == (engine, cuda, 1, False) and kv_args[0] is cfg.rl
    assert (
        est.activation_bytes_per_token == 1000 and est.one_sequence_with_checkpointing == 100 * seq
    )
    assert est.checkpoint_layers is False and est.engine_weights == 9000 and est.kv_cache == 8000


def test_a_recipe_with_an_fp8_kv_cache_asks_for_its_bytes(monkeypatch):
    terms = _Terms(monkeypatch)
    model_cfg, plan, cfg = _plan_and_cfg({"device": "cuda"}, kv_fp8=True)
    memory.estimate_memory(model_cfg, plan, cfg, prompt_tokens=8, capacity=None)
    assert terms.calls["kv_cache_bytes"][0][-1] is True


def test_placed_terms_are_whole_bytes_per_train_rank(monkeypatch):
    """Three colocated train ranks: the fixed terms are each rank's share in whole bytes (floor
    division, ints), the logits chunk is sized for the rank's groups (3 prompts over 3 ranks:
    one prompt's 4 samples), and nothing is held under a placement (FSDP2 casts per use)."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    terms = _Terms(monkeypatch)
    rl = {"device": "cuda", "prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 8}
    model_cfg, plan, cfg = _plan_and_cfg(rl, {"mode": "colocated", "train_ranks": 3})
    est = memory.estimate_memory(model_cfg, plan, cfg, prompt_tokens=8, capacity=None)
    numel = sum(math.prod(s.shape) for s in plan.values())
    seq = 16
    want = {
        "master_weights": numel * 4 // 3, "gradients": numel * 4 // 3,
        "optimizer": 2 * numel * 4 // 3, "train_weight_copies": 500 // 3, "held_bf16_bytes": 0,
        "step_tokens": 2 * 4 * seq,  # ceil(4 prompts / 3 ranks) = 2 prompts x 4 samples
        "micro_batch_tokens": 2 * 4 * seq,
    }  # fmt: skip
    for name, value in want.items():
        got = getattr(est, name)
        assert type(got) is int and got == value, (name, got, value)
    assert terms.calls["logits_chunk_bytes"] == [(model_cfg.vocab_size, 2 * 4 * seq)]
    assert terms.calls["train_copy_bytes"][0][-1] is False  # asked with nothing held


@pytest.mark.parametrize(
    ("fits", "tokens", "budget"),
    [
        (1000, 768, "derived"),  # a multiple of 256 under what fits
        (400, 300, "derived"),  # 256 would not hold the 300-token sequence: the sequence
        (299, 299, "derived"),  # not one sequence: what fits (check() refuses it)
        (2400, 2400, "whole step"),  # the whole step fits exactly
        (5000, 2400, "whole step"),
    ],
)
def test_the_derived_budget_by_hand(monkeypatch, fits, tokens, budget):
    """1000 bytes a token, 300-token sequences, 8 of them a step: the budget for a capacity
    that leaves room for `fits` tokens after the fixed terms and the logits chunk."""
    _Terms(monkeypatch)
    rl = {"device": "cuda", "prompts_per_step": 1, "samples_per_prompt": 8, "max_new_tokens": 292}
    rl["hold_bf16_weights"] = False  # auto would retry a refused estimate without the copies
    model_cfg, plan, cfg = _plan_and_cfg(rl)
    free = memory.estimate_memory(model_cfg, plan, cfg, prompt_tokens=8, capacity=None)
    assert free.step_tokens == 2400 and free.longest_sequence == 300
    usable = free.train_side + free.logits_chunk + fits * 1000 + 500
    est = memory.estimate_memory(
        model_cfg, plan, cfg, prompt_tokens=8, capacity=math.ceil(usable / memory.SAFETY)
    )
    assert (est.micro_batch_tokens, est.budget) == (tokens, budget)
    assert type(est.micro_batch_tokens) is int
