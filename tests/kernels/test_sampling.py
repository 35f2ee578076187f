"""The one-launch sampler (mxrl.kernels.sampling) under Triton's interpreter: the tokens and
processed logprobs of the engine's batched torch sampler (the same noise integers), greedy rows
their argmax, and a row's result independent of its batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxrl.engine import SamplingParams
from mxrl.engine.sampler import SamplingBatch, sample_batch
from mxrl.kernels.sampling import sample_rows
from tests.engine import sampling_spec as spec
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


@interpreter
def test_fused_sample_batch_keeps_a_rows_path_in_a_mixed_batch():
    """sample_batch(fused=True) over rows with and without top-k / top-p: every row's token is
    the spec's (a NumPy transcription of the filters and of the noise hash, the race in
    float64; greedy rows the argmax) and its logprob the spec's processed one, whichever path
    it took; a row alone gives its bytes in the mixed batch (its path is fixed by its own
    parameters: the fused kernel for plain rows, the torch pass for filtered ones)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 1200, generator=g) * 3
    kinds = [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=0.0),
             dict(temperature=1.0, top_p=0.8)]  # fmt: skip
    params = [SamplingParams(seed=7 + i, **kinds[i % 4]) for i in range(8)]
    seeds, counters = [p.seed for p in params], [3 * i for i in range(8)]
    b = SamplingBatch.build(params, seeds, counters, "cpu")
    tokens, logps = sample_batch(logits, b, fused=True)
    for r in range(8):
        kw = kinds[r % 4]
        probs = spec.processed_probs(logits[r].tolist(), **kw)
        if kw["temperature"] == 0.0:
            want = int(np.argmax(probs))
        else:
            want = spec.race(probs, seeds[r], counters[r])
        assert tokens[r].item() == want, f"row {r} {kw}"
        assert logps[r].item() == pytest.approx(np.log(probs[want]), abs=2e-6), f"row {r}"
    for r in range(8):
        alone = SamplingBatch.build(params[r : r + 1], seeds[r : r + 1], counters[r : r + 1], "cpu")
        t, lp = sample_batch(logits[r : r + 1], alone, fused=True)
        assert t.item() == tokens[r].item(), f"row {r}"
        assert_bytes_equal(lp, logps[r : r + 1], f"row {r} alone")


@interpreter
def test_a_row_cut_into_parts_keeps_the_lowest_index_of_a_tie_and_skips_masked_parts():
    """A row spans several parts of the kernel (5000 logits: three parts of 2048): a greedy tie
    between two parts goes to the lower index, as torch.argmax; a part of -inf logits (a masked
    vocabulary range) adds nothing and draws nothing; sampled rows match the reference."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5000, generator=g)
    logits[0, 100] = logits[0, 4500] = 50.0  # greedy: the tie across parts
    logits[1:, 2048:4096] = float("-inf")  # the middle part masked
    params = [SamplingParams(temperature=0.0, seed=1)] + [
        SamplingParams(temperature=t, seed=2 + i) for i, t in enumerate((1.0, 0.5, 2.0))
    ]
    b = SamplingBatch.build(params, [p.seed for p in params], [7, 8, 9, 10], "cpu")
    tokens, logps = sample_rows(logits, b.temperature, b.greedy, b.seeds, b.counters)
    want_tokens, want_logps = sample_batch(logits, b)
    assert tokens[0].item() == 100
    assert torch.equal(tokens, want_tokens)
    assert not ((tokens[1:] >= 2048) & (tokens[1:] < 4096)).any()
    assert torch.isfinite(logps).all()
    torch.testing.assert_close(logps, want_logps, rtol=0, atol=2e-6)
