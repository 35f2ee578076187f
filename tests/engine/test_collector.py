"""The garbage collector around a rollout (`mxrl.engine.collector`): off while `generate`
runs, its previous state restored after (also when the call fails), and safe to be off: a
rollout leaves no reference cycle behind for it to reclaim."""

from __future__ import annotations

import gc

import pytest
import torch

from mxrl.engine import Engine, SamplingParams
from mxrl.engine.collector import collector_paused
from tests.engine.test_engine import tiny


def _rollout(engine: Engine, n: int = 16):
    prompts = [[(i * 7 + j) % 60 + 1 for j in range(9)] for i in range(n // 4)]
    prompts = [p for p in prompts for _ in range(4)]  # groups sharing a prompt's blocks
    params = [SamplingParams(temperature=1.0, max_new_tokens=20, seed=i) for i in range(n)]
    return engine.generate(prompts, params)


def test_generate_runs_with_the_collector_off_and_restores_it(monkeypatch):
    engine = Engine(tiny(), "bf16", weight_dtype=torch.float32, tile=8)
    seen = []
    advance = Engine._advance

    def watched(self, *a, **k):
        seen.append(gc.isenabled())
        return advance(self, *a, **k)

    monkeypatch.setattr(Engine, "_advance", watched)
    assert gc.isenabled()
    _rollout(engine, 4)
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()  # a caller that turned it off keeps it off
    try:
        _rollout(engine, 4)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="prompt 0"):
        engine.generate([[]], SamplingParams())
    assert gc.isenabled()


def test_the_block_restores_the_state_it_found():
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()


def test_a_rollout_leaves_no_cycle_for_the_collector():
    """What makes pausing the collector safe: after a warm rollout, a second one (prefix hits,
    routing records, finished requests freeing their blocks) leaves no unreachable object."""
    engine = Engine(tiny(), "bf16", weight_dtype=torch.float32, tile=8)
    _rollout(engine)
    gc.collect()
    gc.disable()
    try:
        outs = _rollout(engine)
        assert gc.collect() == 0
    finally:
        gc.enable()
    assert len(outs) == 16 and all(o.routed_experts is not None for o in outs)
