"""The batched sampler: counter-based noise (a hash of seed, counter and vocabulary index), draws
that follow the processed distribution, rows that do not depend on their batch."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from mxrl.engine import SamplingParams
from mxrl.engine.sampler import (
    SamplingBatch,
    processed_logprobs_batch,
    sample_batch,
    uniform_noise,
)
from tests.engine import sampling_spec as spec
from tests.numerics import assert_bytes_equal

E1, E2, E4 = math.e, math.e**2, math.e**4


def test_noise_is_exact_integer_arithmetic():
    seeds = [0, 1, 2**31 + 7, 2**40 + 3, 2**62 + 12345]
    counters = [0, 1, 5, 2047, 123456]
    got = uniform_noise(torch.tensor(seeds), torch.tensor(counters), 300)
    for r, (s, c) in enumerate(zip(seeds, counters, strict=True)):
        for v in (0, 1, 2, 150, 299):
            assert got[r, v].item() == spec.uniform(s, c, v), (s, c, v)
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
    errors of the spec's processed probabilities (a NumPy transcription); filtered tokens
    never drawn; each token's logprob is the processed one."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -2.0])
    n = 4000
    for kw in (
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=4),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=0.8, top_k=3, top_p=0.9),
    ):
        params = SamplingParams(**kw)
        b = _batch([params] * n, list(range(n)), [3] * n)
        tokens, logprobs = sample_batch(logits.expand(n, -1), b)
        probs = spec.processed_probs(logits.tolist(), **kw)
        counts = torch.bincount(tokens, minlength=6).double() / n
        for v in range(6):
            se = math.sqrt(max(probs[v] * (1 - probs[v]), 1e-12) / n)
            assert abs(counts[v].item() - probs[v]) <= 5 * se + 1e-9, (kw, v)
            if probs[v] == 0:
                assert counts[v] == 0, (kw, v)
        want = torch.tensor(np.log(probs[tokens.numpy()]), dtype=torch.float64)
        torch.testing.assert_close(logprobs.double(), want, rtol=0, atol=1e-6)
        # and byte for byte the processed logprob the sampler reports for checks
        lp = processed_logprobs_batch(logits[None], b.rows(0, 1))[0]
        assert_bytes_equal(logprobs, lp[tokens], "processed logprob of the token drawn")


def test_each_draw_is_the_race_of_its_own_noise():
    """Each request's token is argmax p / E with E = -log u from the spec's hash of (seed,
    counter, index), p the spec's processed distribution: per request, not in distribution."""
    logits = torch.randn(24, 50, generator=torch.Generator().manual_seed(4)) * 2
    kinds = [dict(temperature=1.0), dict(temperature=0.6, top_k=5),
             dict(temperature=1.2, top_p=0.7), dict(temperature=0.9, top_k=8, top_p=0.6)]  # fmt: skip
    kws = [kinds[i % 4] for i in range(24)]
    seeds, counters = [1000 + 7 * i for i in range(24)], [i * i for i in range(24)]
    b = _batch([SamplingParams(**kw) for kw in kws], seeds, counters)
    tokens, _ = sample_batch(logits, b)
    for r, kw in enumerate(kws):
        probs = spec.processed_probs(logits[r].tolist(), **kw)
        assert tokens[r].item() == spec.race(probs, seeds[r], counters[r]), (r, kw)


# Hand-computed kept sets: (logits, sampling parameters, {kept token: its probability}).
HAND = {
    # top-k first, then top-p on the renormalised pair: .55/.8 = .6875 >= .65 ends the nucleus
    # at one token; top-p first (on .55 .25 .2) would keep two, and top-k then both
    "issue: top-k 2 then top-p .65": (np.log([0.55, 0.25, 0.2]), dict(top_k=2, top_p=0.65),
                                      {0: 1.0}),
    "top-p .65 alone keeps the crossing token": (np.log([0.55, 0.25, 0.2]), dict(top_p=0.65),
                                                 {0: 0.6875, 1: 0.3125}),
    "top-k 2 alone": (np.log([0.55, 0.25, 0.2]), dict(top_k=2), {0: 0.6875, 1: 0.3125}),
    # four equal tokens: cumulative .25 .5 .75; the token reaching exactly p is the last kept
    "top-p ties by index": ([0.0, 0.0, 0.0, 0.0], dict(top_p=0.5), {0: 0.5, 1: 0.5}),
    # two tied leaders: the lower index first, so p = .3 keeps token 0, never token 2
    "top-p tie keeps the lower index": ([1.0, 0.0, 1.0, 0.0], dict(top_p=0.3), {0: 1.0}),
    # top-k keeps every token tied with the k-th largest: 1 1 1 all reach it
    "top-k ties at the boundary": ([2.0, 1.0, 1.0, 1.0, 0.0], dict(top_k=2),
                                   {0: E2 / (E2 + 3 * E1), 1: E1 / (E2 + 3 * E1),
                                    2: E1 / (E2 + 3 * E1), 3: E1 / (E2 + 3 * E1)}),
    # ... then top-p .7 over .4754 .1749 .1749 .1749 (cumulative .4754 .6503 .8251): the tie
    # is cut by index, token 3 goes
    "top-k ties then top-p": ([2.0, 1.0, 1.0, 1.0, 0.0], dict(top_k=2, top_p=0.7),
                              {0: E2 / (E2 + 2 * E1), 1: E1 / (E2 + 2 * E1),
                               2: E1 / (E2 + 2 * E1)}),
    # temperature first: [4, 2, 0, -2] over top-3 is .8668 .1173 .0159, so .95 drops token 2
    # (unscaled, .6652 .2447 .0900 would keep all three)
    "temperature then top-k 3 then top-p .95": ([2.0, 1.0, 0.0, -1.0],
                                                dict(temperature=0.5, top_k=3, top_p=0.95),
                                                {0: E4 / (E4 + E2), 1: E2 / (E4 + E2)}),
    # greedy rows keep the unscaled distribution under their filters
    "greedy with top-k 2": ([2.0, 1.0, 0.0], dict(temperature=0.0, top_k=2),
                            {0: E2 / (E2 + E1), 1: E1 / (E2 + E1)}),
    "top-k 1": ([0.5, 3.0, -1.0], dict(top_k=1), {1: 1.0}),
    "top-k >= vocab is off": ([0.0, 0.0], dict(top_k=5), {0: 0.5, 1: 0.5}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HAND))
def test_top_k_and_top_p_keep_the_hand_computed_sets(case):
    logits, kw, kept = HAND[case]
    lp = processed_logprobs_batch(
        torch.tensor(logits, dtype=torch.float32)[None], _batch([SamplingParams(**kw)], [0], [0])
    )[0]
    assert set(torch.isfinite(lp).nonzero()[:, 0].tolist()) == set(kept), case
    for v, p in kept.items():
        assert lp[v].exp().item() == pytest.approx(p, rel=1e-6), (case, v)
    # the transcription of the spec agrees with the hand values (it is the oracle elsewhere)
    want = spec.processed_probs(logits, **kw)
    assert {v for v in range(len(want)) if want[v] > 0} == set(kept)
    assert [want[v] for v in kept] == pytest.approx(list(kept.values()), rel=1e-12)


def test_filters_on_random_rows_keep_the_spec_sets():
    """Random rows under mixed parameters: the kept sets are the transcription's and the
    probabilities agree to float32 rounding (rows whose top-p cumulative mass falls within 1e-4
    of p are not such cases: none here, asserted)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 64, generator=g) * 2
    kws = [dict(temperature=t, top_k=k, top_p=p) for t, k, p in
           itertools.product((0.7, 1.0), (0, 1, 7, 40), (1.0, 0.5))]  # fmt: skip
    b = _batch([SamplingParams(**kw) for kw in kws], list(range(16)), [0] * 16)
    lp = processed_logprobs_batch(logits, b)
    for r, kw in enumerate(kws):
        assert spec.top_p_margin(logits[r].tolist(), **kw) > 1e-4, r
        want = spec.processed_probs(logits[r].tolist(), **kw)
        got = lp[r].double().exp().numpy()
        assert ((got > 0) == (want > 0)).all(), (r, kw)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


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
