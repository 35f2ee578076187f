"""The engine's `attention_split` (keys per split of the Triton paged attention): checked where it
is set, carried to every attention of a step, and, under Triton's interpreter, batch-invariant
and recomputed after preemption byte for byte, close to the one-pass engine (not its bytes)."""

from __future__ import annotations

import pytest
import torch

from mxrl.engine import CacheOptions, Engine, EngineConfig, SamplingParams
from mxrl.rl.config import GRPOConfig
from tests.engine.test_engine import tiny
from tests.engine.test_scheduler import _params, _same
from tests.kernels.test_decode_gemm import interpreter

# prompts past one 16-key split: 37 and 20 tokens, then 12 new ones
PROMPTS = [[(7 * i + 3) % 60 + 1 for i in range(37)], [(5 * i + 1) % 60 + 1 for i in range(20)],
           [9, 8, 7]]  # fmt: skip


@pytest.mark.parametrize("bad", [-16, 24, 8, "512", 512.0, True])
def test_a_split_that_is_not_a_multiple_of_the_block_is_refused(bad):
    with pytest.raises(ValueError, match=r"attention_split must be 0 .* multiple of the KV block"):
        EngineConfig(attention_split=bad)
    with pytest.raises(ValueError, match="multiple of the KV block size 32"):
        EngineConfig(attention_split=48, cache=CacheOptions(block_size=32))
    assert EngineConfig(attention_split=64, cache=CacheOptions(block_size=32)).attention_split == 64
    assert EngineConfig().attention_split == 0


def test_the_run_config_takes_it_and_checks_it():
    from mxrl.rl.resolve import resolve_train

    assert GRPOConfig(engine_attention_split=512).engine_attention_split == 512
    assert GRPOConfig().engine_attention_split == 0
    for bad, match in ((24, "multiple of the KV block size 16"), (-16, ">= 0"),
                       ("x", "whole number")):  # fmt: skip
        with pytest.raises(ValueError, match=f"rl.engine_attention_split: .*{match}"):
            GRPOConfig(engine_attention_split=bad)
    resolved = resolve_train(GRPOConfig(engine_attention_split=32), tiny(), "cpu")
    assert resolved.engine.attention_split == 32


@interpreter
def test_the_cache_carries_it_to_the_kernels_launch(monkeypatch):
    """Every attention of a step (the kernel's path) passes the engine's split and the keys its
    block tables can hold."""
    import mxrl.kernels.attention as attention

    calls = []
    real = attention.paged_attention

    def spy(*args, split_keys=0, max_keys=0):
        calls.append((split_keys, max_keys, args[3].shape[1]))
        return real(*args, split_keys=split_keys, max_keys=max_keys)

    monkeypatch.setattr(attention, "paged_attention", spy)
    engine = Engine(tiny(), "bf16", backend="triton", weight_dtype=torch.float32, tile=8,
                    attention_split=32)  # fmt: skip
    assert engine._attention_kernel
    engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=2))
    # 4 layers x (a prefill step, a decode step), every table 3 blocks wide (38 tokens)
    assert calls == [(32, 48, 3)] * 8


@interpreter
def test_batch_invariant_and_close_to_one_pass():
    model = tiny()
    split = Engine(model, "bf16", backend="triton", weight_dtype=torch.float32, tile=8,
                   attention_split=16)  # fmt: skip
    params = _params(3)
    batch = split.generate(PROMPTS, params)
    for i in range(3):
        _same(split.generate([PROMPTS[i]], params[i : i + 1]), batch[i : i + 1], f"alone {i}")
    one_pass = Engine(model, "bf16", backend="triton", weight_dtype=torch.float32, tile=8)
    for got, want in zip(batch, one_pass.generate(PROMPTS, params), strict=True):
        assert got.tokens == want.tokens
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)


@interpreter
def test_preemption_recomputes_the_same_bytes(monkeypatch):
    """Recomputed by prefill after preemption, a sequence's splits fall where they fell while
    it decoded: the same bytes as a cache that never preempts."""
    from mxrl.engine.scheduler import Scheduler

    model = tiny()
    prompts = [[(i * 11 + j) % 60 + 1 for j in range(15)] for i in range(4)]
    params = _params(4)
    kw = dict(backend="triton", weight_dtype=torch.float32, tile=8, attention_split=16)
    want = Engine(model, "bf16", **kw).generate(prompts, params)
    preempted = []
    original = Scheduler._preempt
    monkeypatch.setattr(
        Scheduler, "_preempt", lambda self, seq: (preempted.append(seq.index), original(self, seq))
    )
    per_block = 2 * 4 * 16 * 2 * 16 * 4  # k+v, 4 layers, 16 tokens, 2 kv heads, dim 16, fp32
    tight = Engine(model, "bf16", cache=CacheOptions(kv_cache_bytes=5 * per_block), **kw)
    _same(tight.generate(prompts, params), want, "preempted")
    assert preempted, "the cache was meant to be too small for all four at once"


@pytest.mark.gpu
def test_on_cuda_graphs_give_the_eager_bytes_and_batch_invariance_holds():
    """The split attention in the CUDA-graph decode (its splits from the graph's table width)
    against eager steps, and a request alone against the batch: byte for byte."""
    model = tiny()
    prompts = PROMPTS * 3
    params = _params(len(prompts))
    kw = dict(device="cuda", compute_dtype=torch.bfloat16, attention_split=32)
    graphs = Engine(model, "bf16", **kw)
    assert graphs.cuda_graphs
    got = graphs.generate(prompts, params)
    assert graphs.stats.graph_steps > 0
    _same(Engine(model, "bf16", cuda_graphs=False, **kw).generate(prompts, params), got, "eager")
    _same(graphs.generate(prompts[1:2], params[1:2]), got[1:2], "alone")
