"""The one-launch sampler (mxrl.kernels.sampling) under Triton's interpreter: the tokens and
processed logprobs of the engine's batched torch sampler (the same noise integers), greedy rows
their argmax, and a row's result independent of its batch."""

from __future__ import annotations

import torch

from mxrl.engine import SamplingParams
from mxrl.engine.sampler import SamplingBatch, sample_batch
from mxrl.kernels.sampling import sample_rows
from tests.kernels.test_decode_gemm import interpreter
from tests.numerics import assert_bytes_equal


def _case(r=48, v=3000, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(r, v, generator=g) * 3
    params = [
        SamplingParams(temperature=[1.0, 0.0, 0.7, 1.3][i % 4], seed=100 + i) for i in range(r)
    ]
    b = SamplingBatch.build(params, [p.seed for p in params], [5 * i for i in range(r)], "cpu")
    return logits, b


@interpreter
def test_kernel_draws_the_reference_samplers_tokens():
    logits, b = _case()
    tokens, logps = sample_rows(logits, b.temperature, b.greedy, b.seeds, b.counters)
    want_tokens, want_logps = sample_batch(logits, b)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logps, want_logps, rtol=0, atol=2e-6)
    greedy = b.greedy
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))


@interpreter
def test_kernel_rows_do_not_depend_on_the_batch():
    logits, b = _case(r=9, v=1500, seed=1)
    tokens, logps = sample_rows(logits, b.temperature, b.greedy, b.seeds, b.counters)
    for r in (0, 4, 8):
        t, lp = sample_rows(
            logits[r : r + 1], b.temperature[r : r + 1], b.greedy[r : r + 1],
            b.seeds[r : r + 1], b.counters[r : r + 1],
        )  # fmt: skip
        assert t.item() == tokens[r].item()
        assert_bytes_equal(lp, logps[r : r + 1], f"row {r}")
