"""Edge cases of mxrl/engine/sampler.py that its mutation run (docs/mutation/engine.sampler.md)
found untested: the trainer's kept tokens (`keep_N`) under each filter, top-p = 1 on a
distribution whose tail float32 rounds into the cumulative mass, top-k when a row is sampled
alone (the CPU path), a batched pass over greedy and sampled rows (the CUDA path), no rows, and
`processed_logprobs` of one row. Every expectation is worked out by hand from the docstrings
(filter_logits: top-k keeps every token reaching the k-th largest, top-p keeps a token while the
mass strictly before it is < p; p = 1 and k = 0 are off)."""

from __future__ import annotations

import math

import pytest
import torch

from mxrl.engine import SamplingParams
from mxrl.engine.sampler import (
    SamplingBatch,
    _sample_rows,
    filter_logits,
    processed_logprobs,
    processed_logprobs_batch,
    sample_batch,
)

INF = float("inf")


def _batch(params, seeds=None, counters=None):
    n = len(params)
    return SamplingBatch.build(params, seeds or list(range(n)), counters or [0] * n, "cpu")


def _finite(t: torch.Tensor) -> list[int]:
    return torch.isfinite(t).nonzero()[:, 0].tolist()


def test_kept_tokens_survive_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # top-2 keeps 0 and 1; the trainer's sampled token 3 keeps its logit
    got = filter_logits(logits, torch.tensor([2]), keep_N=torch.tensor([3]))[0]
    assert got.tolist() == [2.0, 1.0, -INF, -1.0]
    assert filter_logits(logits, torch.tensor([2]))[0].tolist() == [2.0, 1.0, -INF, -INF]


def test_kept_tokens_survive_top_p():
    # probabilities .5 .3 .2: mass before each is 0 .5 .8, so p = .5 keeps token 0 alone
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    got = filter_logits(logits, top_p_N=torch.tensor([0.5]), keep_N=torch.tensor([2]))[0]
    assert _finite(got) == [0, 2] and got[2] == logits[0, 2]
    assert _finite(filter_logits(logits, top_p_N=torch.tensor([0.5]))[0]) == [0]
    # one kept token per row, each in its own row
    two = torch.cat([logits, logits])
    got = filter_logits(two, top_p_N=torch.tensor([0.5, 0.5]), keep_N=torch.tensor([1, 2]))
    assert [_finite(r) for r in got] == [[0, 1], [0, 2]]


def test_top_p_of_one_is_off_even_where_float32_rounds_the_mass_to_one():
    # probabilities 1 - e^-30 and e^-30 (9.4e-14): in float32 the first is 1.0, so the mass
    # before the second is 1.0. p = 1 is off: the second token stays
    logits = torch.tensor([[0.0, -30.0]])
    assert _finite(filter_logits(logits, top_p_N=torch.tensor([1.0]))[0]) == [0, 1]
    lp = processed_logprobs_batch(logits, _batch([SamplingParams()]))[0]
    assert lp[1].item() == pytest.approx(-30.0, abs=1e-5)
    # the same in a batch where another row asks for top-p
    b = _batch([SamplingParams(top_p=0.5), SamplingParams()])
    lp = processed_logprobs_batch(logits.expand(2, -1), b)
    assert _finite(lp[0]) == [0] and _finite(lp[1]) == [0, 1]


def test_top_k_applies_when_each_row_is_sampled_alone():
    # 50 nearly equal logits: top-1 must draw token 0 with logprob 0 whatever the noise
    logits = -0.01 * torch.arange(50, dtype=torch.float32)[None].expand(3, -1)
    params = [SamplingParams(top_k=1), SamplingParams(top_k=1), SamplingParams()]
    tokens, lps = sample_batch(logits, _batch(params, [7, 8, 9], [0, 1, 2]))
    assert tokens[:2].tolist() == [0, 0] and lps[:2].tolist() == [0.0, 0.0]
    assert lps[2].item() < math.log(0.1)  # the unfiltered row: about 1/50 each


def test_one_batched_pass_over_greedy_and_sampled_rows():
    # the CUDA path: _sample_rows on [R, V] at once. The greedy row takes its own argmax (3),
    # not an index into the flattened batch
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    b = _batch([SamplingParams(top_k=1), SamplingParams(temperature=0.0)])
    tokens, lps = _sample_rows(logits, b)
    assert tokens[1].item() == 3
    e = [math.exp(v) for v in (0.0, 1.0, 2.0, 3.0)]
    assert lps[1].item() == pytest.approx(math.log(e[3] / sum(e)), rel=1e-6)
    assert lps[0].item() == pytest.approx(math.log(0.25), rel=1e-6)  # top-1 keeps the 4 ties
    # all greedy: each row its argmax
    g = _batch([SamplingParams(temperature=0.0)] * 2)
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0]])
    assert _sample_rows(logits, g)[0].tolist() == [1, 0]


def test_no_rows_sample_nothing():
    tokens, lps = sample_batch(torch.zeros(0, 7), _batch([]))
    assert tokens.shape == (0,) and tokens.dtype == torch.int64
    assert lps.shape == (0,) and lps.dtype == torch.float32


def test_processed_logprobs_of_one_row():
    # temperature .5 doubles the logits [1, .5, 0] -> [2, 1, 0]; top-2 keeps [2, 1]
    got = processed_logprobs(
        torch.tensor([1.0, 0.5, 0.0]), SamplingParams(temperature=0.5, top_k=2)
    )
    e2, e1 = math.exp(2.0), math.exp(1.0)
    assert got.shape == (3,) and got[2].item() == -INF
    assert got[:2].tolist() == pytest.approx([math.log(e2 / (e2 + e1)), math.log(e1 / (e2 + e1))])
    # top-p .5 over .5 .3 .2: token 0 alone; greedy: the unscaled distribution
    got = processed_logprobs(torch.tensor([0.5, 0.3, 0.2]).log(), SamplingParams(top_p=0.5))
    assert _finite(got) == [0] and got[0].item() == 0.0
    got = processed_logprobs(torch.tensor([0.5, 0.3, 0.2]).log(), SamplingParams(temperature=0))
    assert got.exp().tolist() == pytest.approx([0.5, 0.3, 0.2], rel=1e-6)


def test_on_the_cpu_each_row_is_sampled_alone(monkeypatch):
    # the module docstring: on the CPU a row is processed alone, as a [1, V] tensor (ATen's
    # vector body and scalar tail round differently, so a row's bytes would depend on its batch)
    from mxrl.engine import sampler

    shapes = []
    original = sampler._sample_rows

    def spy(logits_RV, b):
        shapes.append(tuple(logits_RV.shape))
        return original(logits_RV, b)

    monkeypatch.setattr(sampler, "_sample_rows", spy)
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=2)]
    tokens, _ = sample_batch(torch.randn(3, 11, generator=torch.Generator().manual_seed(0)),
                             _batch(params))  # fmt: skip
    assert shapes == [(1, 11)] * 3 and tokens.shape == (3,)
