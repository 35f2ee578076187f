"""deepseek_v3 weights reach the engine in every format the presets store, and MLA's cached prefixes serve
other requests: a trainer's export sent through the in-process transport (every record's
checksum verified) lands in the engine, which then holds the bytes and computes the logits of an
engine built on those weights, and gives the trainer's logprobs (`LOGPROBS`); a prompt's cached blocks (MLA's
expanded keys and values) serve a later request with the bytes that request gets computed from
its first token. The Qwen3-MoE versions: tests/engine/test_load_in_place.py,
tests/engine/test_kv_fp8.py."""

from __future__ import annotations

import pytest
import torch

from mxrl.app.probe import measure_mismatch
from mxrl.engine import Engine, SamplingParams
from mxrl.engine.block_manager import BlockManager
from mxrl.nn import apply_plan
from mxrl.sync import InProcessTransport
from mxrl.weights import export
from tests.engine.test_deepseek_engine import _prompts, _trainer
from tests.models.test_deepseek_v3_training import PRESETS, WIDE
from tests.numerics import assert_bytes_equal, assert_same_outputs
from tests.sync.helpers import engine_logits, hashes

# every weight format the presets store (the backward modes share their forward's weights:
# mxfp8-hp / -dequantized store mxfp8's bytes, nvfp4-dequantized nvfp4-hp's, fp8-block-quantized
# fp8-block's)
STORED = ("bf16", "mxfp8", "nvfp4-hp", "nvfp4-4over6-hp", "fp8-block")
assert set(STORED) <= set(PRESETS)
# the presets whose engine logprobs no other DeepSeek test compares with the trainer's
# (test_deepseek_engine.py: bf16, mxfp8, nvfp4-dequantized)
LOGPROBS = ("fp8-block", "nvfp4-hp")


@pytest.mark.parametrize("preset", STORED)
def test_a_sync_lands_every_presets_bytes_and_the_trainers_logprobs(preset):
    engine = Engine(_trainer(WIDE, seed=0), preset, weight_dtype=torch.float32)
    before = engine_logits(engine)
    trainer = _trainer(WIDE, seed=1)
    report = InProcessTransport(engine).send(
        export(trainer, engine.plan, step=1, bf16_dtype=torch.float32)
    )
    assert report.version == 2 and report.num_tensors == len(engine.plan)
    fresh = Engine(trainer, preset, weight_dtype=torch.float32)
    assert hashes(engine.records()) == hashes(fresh.records())
    after = engine_logits(engine)
    assert not torch.equal(after, before)
    assert_bytes_equal(after, engine_logits(fresh), f"{preset} logits after the sync")
    if preset not in LOGPROBS:
        return
    apply_plan(trainer, engine.plan)
    m = measure_mismatch(trainer, engine, _prompts(4), SamplingParams(max_new_tokens=6, seed=0))
    assert m.num_tokens == 4 * 6
    assert m.logp_abs_diff_max < 1e-5 and m.k3 < 1e-10, m


@pytest.mark.parametrize("preset", ["bf16", "mxfp8"])
def test_mla_cached_prefixes_serve_later_requests_with_fresh_bytes(preset, monkeypatch):
    hits: list[int] = []
    admit = BlockManager.admit

    def counting(self, seq, cached):
        hits.append(len(cached))
        return admit(self, seq, cached)

    monkeypatch.setattr(BlockManager, "admit", counting)
    engine = Engine(_trainer("qlora-grouped-shared1"), preset, tile=8)
    block = engine.cache_options.block_size
    shared = [(7 * i) % 60 + 1 for i in range(40)]  # two whole blocks and a part
    assert len(shared) >= 2 * block
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=20 + i) for i in range(3)]
    prompts = [[*shared, 1], [*shared, 2, 3], shared]
    fresh = []
    for p, q in zip(prompts, params, strict=True):  # each computed from its first token
        engine.reset_prefix_cache()
        hits.clear()
        fresh.append(engine.generate([p], [q])[0])
        assert hits == [0]
    engine.reset_prefix_cache()
    engine.generate([shared], [params[0]])  # caches the shared prompt's whole blocks
    hits.clear()
    later = engine.generate(prompts, params)
    assert min(hits) >= len(shared) // block - 1 > 0, hits  # read from the cache
    assert_same_outputs(fresh, later, "cached prefix")
