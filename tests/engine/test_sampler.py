"""The batched sampler: counter-based noise (a hash of seed, counter and vocabulary index), draws
that follow the processed distribution, rows that do not depend on their batch."""

from __future__ import annotations

import math

import pytest
import torch

from mxrl.engine import SamplingParams
from mxrl.engine.sampler import (
    SamplingBatch,
    processed_logprobs_batch,
    sample_batch,
    uniform_noise,
)
from tests.numerics import assert_bytes_equal

M32 = 0xFFFFFFFF


def _mix32_py(x: int) -> int:
    """The hash's rounds on Python integers (unbounded: no int64 wrap can hide here)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & M32
    return x ^ (x >> 16)


def _uniform_py(seed: int, counter: int, v: int) -> float:
    lo, hi = seed & M32, (seed >> 32) & M32
    row = _mix32_py(lo ^ _mix32_py(hi ^ _mix32_py((counter * 0x1E3779B9 + 1) & M32)))
    x = _mix32_py(row ^ ((v * (0x5BD1E995 & 0x7FFFFFFF)) & M32))
    x = _mix32_py(x ^ row)
    return ((x >> 9) + 0.5) / (1 << 23)


def test_noise_is_exact_integer_arithmetic():
    seeds = [0, 1, 2**31 + 7, 2**40 + 3, 2**62 + 12345]
    counters = [0, 1, 5, 2047, 123456]
    got = uniform_noise(torch.tensor(seeds), torch.tensor(counters), 300)
    for r, (s, c) in enumerate(zip(seeds, counters, strict=True)):
        for v in (0, 1, 2, 150, 299):
            assert got[r, v].item() == _uniform_py(s, c, v), (s, c, v)
    assert (got > 0).all() and (got < 1).all()


def test_noise_is_uniform_and_rows_differ():
    u = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert len({tuple(row[:8].tolist()) for row in u}) == 64
    # the counter moves a request to fresh noise
    v = uniform_noise(torch.arange(64), torch.ones(64, dtype=torch.int64), 4096)
    assert (u != v).float().mean() > 0.99


def _batch(params, seeds, counters):
    return SamplingBatch.build(params, seeds, counters, torch.device("cpu"))


def test_draws_follow_the_processed_distribution():
    """4000 requests (seeds) drawing from the same logits: frequencies within 5 standard
    errors of the processed probabilities; filtered tokens never drawn."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -2.0])
    n = 4000
    for params in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
    ):
        b = _batch([params] * n, list(range(n)), [3] * n)
        tokens, logprobs = sample_batch(logits.expand(n, -1), b)
        probs = processed_logprobs_batch(logits[None], b.rows(0, 1))[0].exp()
        counts = torch.bincount(tokens, minlength=6).double() / n
        for v in range(6):
            se = math.sqrt(max(probs[v].item() * (1 - probs[v].item()), 1e-12) / n)
            assert abs(counts[v].item() - probs[v].item()) <= 5 * se + 1e-9, (params, v)
            if probs[v] == 0:
                assert counts[v] == 0
        assert_bytes_equal(logprobs, probs.log()[tokens], "processed logprob of the token drawn")


def test_a_row_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 1000, generator=g) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.5),
        SamplingParams(temperature=0.0, top_k=3),
        SamplingParams(temperature=2.0),
    ]
    seeds, counters = [11, 12, 13, 14, 15, 16, 17], [0, 4, 9, 1, 2, 3, 100]
    tokens, lps = sample_batch(logits, _batch(params, seeds, counters))
    for r in range(7):
        t, lp = sample_batch(
            logits[r : r + 1], _batch(params[r : r + 1], seeds[r : r + 1], counters[r : r + 1])
        )
        assert t.item() == tokens[r].item(), r
        assert_bytes_equal(lp, lps[r : r + 1], f"row {r}")
    assert tokens[0].item() == logits[0].argmax().item()  # greedy


@pytest.mark.parametrize("k", [1, 5, 1000, 2000])
def test_top_k_keeps_the_k_largest(k):
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(k))
    lp = processed_logprobs_batch(logits, _batch([SamplingParams(top_k=k)] * 2, [0, 0], [0, 0]))
    assert (torch.isfinite(lp).sum(-1) == min(k, 1000)).all()
