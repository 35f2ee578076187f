"""`sample_batch(fused=True)` on the CPU without Triton: the one-launch sampler
(`mxrl.kernels.sampling.sample_rows`) replaced by a stand-in whose results no real sampler can
give (token 1000 + row, logprob row + 0.5 > 0), so each row's result names the path it took.
What is checked is the branch around the kernel (docs/mutation/engine.sampler.md): which rows
are filtered (top-k with 0 < k < V, or top-p < 1: the `filter_logits` docstring's "k = 0 or
>= V: off", "p = 1: off"), the kernel called on the whole batch with its own parameters, the
filtered rows' torch results put back in row order, and a batch without filters never running
the torch pass. The filtered rows' tokens and logprobs are worked out by hand (top-1 or a
nucleus of one token: the row's argmax with logprob 0; a greedy top-8 row: its argmax over the
8 kept). The kernel itself is held to the torch sampler under Triton's interpreter
(tests/kernels/test_sampling.py) and on the GPU (tests/engine/test_gpu.py).

Also here: top-p's sort breaks ties by vocabulary index (stable), which the kept set shows."""

from __future__ import annotations

import math

import pytest
import torch

from mxrl.engine import SamplingParams
from mxrl.engine import sampler as sampler_module
from mxrl.engine.sampler import SamplingBatch, filter_logits, sample_batch
from mxrl.kernels import sampling

FUSED = 1000  # the stand-in's token for row r: FUSED + r (every vocabulary here is < 100)


def _batch(params):
    n = len(params)
    return SamplingBatch.build(params, [11 + i for i in range(n)], [2 * i for i in range(n)], "cpu")


@pytest.fixture
def fused_calls(monkeypatch):
    """The fused kernel replaced by a stand-in; the list of the argument tuples it was called
    with."""
    calls = []

    def sample_rows(logits_RV, temperature_R, greedy_R, seeds_R, counters_R):
        calls.append((logits_RV, temperature_R, greedy_R, seeds_R, counters_R))
        r = logits_RV.shape[0]
        return torch.arange(r) + FUSED, torch.arange(r, dtype=torch.float32) + 0.5

    monkeypatch.setattr(sampling, "sample_rows", sample_rows)
    return calls


def _called_with_the_batch(calls, logits, b):
    assert len(calls) == 1
    got = calls[0]
    want = (logits, b.temperature, b.greedy, b.seeds, b.counters)
    assert all(g is w for g, w in zip(got, want, strict=True))


def test_unfiltered_rows_take_the_kernel_and_filtered_rows_the_torch_pass(fused_calls):
    v = 16
    logits = torch.zeros(7, v)
    argmax = [0, 5, 0, 0, 9, 12, 0]
    for r, t in enumerate(argmax):
        logits[r, t] = 4.0
    # row 6: greedy top-8 over 8 logits of 0 (one of them, token 3, ln 9) and 8 of -5: the 8
    # kept carry mass 7 + 9 = 16, the argmax 3 gets ln(9/16)
    logits[6] = torch.tensor([0.0] * 8 + [-5.0] * 8)
    logits[6, 3] = math.log(9.0)
    params = [
        SamplingParams(),  # 0: no filter: kernel
        SamplingParams(top_k=1),  # 1: top-1: token 5, logprob 0
        SamplingParams(top_k=0, top_p=1.0),  # 2: both off: kernel
        SamplingParams(top_k=v),  # 3: k = V keeps every token: off, kernel
        SamplingParams(top_p=0.3),  # 4: p .3 on a row of mass ~.78 at token 9: token 9 alone
        SamplingParams(top_k=v + 5, temperature=0.5),  # 5: k > V: off, kernel
        SamplingParams(top_k=8, temperature=0.0),  # 6: greedy top-8 (8 >= the 7 rows)
    ]
    b = _batch(params)
    tokens, logps = sample_batch(logits, b, fused=True)
    _called_with_the_batch(fused_calls, logits, b)
    assert tokens.tolist() == [FUSED + 0, 5, FUSED + 2, FUSED + 3, 9, FUSED + 5, 3]
    assert logps[[0, 2, 3, 5]].tolist() == [0.5, 2.5, 3.5, 5.5]
    assert logps[[1, 4]].tolist() == [0.0, 0.0]
    assert logps[6].item() == pytest.approx(math.log(9.0 / 16.0), rel=1e-6)
    assert tokens.dtype == torch.int64 and logps.dtype == torch.float32


def test_a_batch_of_top_k_rows_only_takes_the_torch_pass_for_them(fused_calls):
    # no row asks for top-p; one row alone (so k = 1 reaches the batch's size, not V's)
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0, 0.5]])
    b = _batch([SamplingParams(top_k=1)])
    tokens, logps = sample_batch(logits, b, fused=True)
    assert tokens.tolist() == [2] and logps.tolist() == [0.0]
    # the same row beside a plain one: the plain one keeps the kernel's result
    logits2 = torch.cat([logits, logits])
    b2 = _batch([SamplingParams(), SamplingParams(top_k=1)])
    tokens, logps = sample_batch(logits2, b2, fused=True)
    assert tokens.tolist() == [FUSED, 2] and logps.tolist() == [0.5, 0.0]


def test_a_batch_of_top_p_rows_only_takes_the_torch_pass_for_them(fused_calls):
    # probabilities .5 .3 .2: p = .5 keeps token 0 alone
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(2, -1)
    b = _batch([SamplingParams(top_p=0.5), SamplingParams()])
    tokens, logps = sample_batch(logits, b, fused=True)
    assert tokens.tolist() == [0, FUSED + 1] and logps.tolist() == [0.0, 1.5]


def test_a_batch_without_filters_never_runs_the_torch_pass(fused_calls, monkeypatch):
    def no_torch_pass(logits_RV, b):
        raise AssertionError("the torch pass ran for rows without top-k / top-p")

    monkeypatch.setattr(sampler_module, "_sample_rows", no_torch_pass)
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=0)]
    b = _batch(params)
    tokens, logps = sample_batch(logits, b, fused=True)
    _called_with_the_batch(fused_calls, logits, b)
    assert tokens.tolist() == [FUSED, FUSED + 1, FUSED + 2] and logps.tolist() == [0.5, 1.5, 2.5]


def test_fused_over_no_rows_samples_nothing(fused_calls):
    tokens, logps = sample_batch(torch.zeros(0, 9), _batch([]), fused=True)
    assert tokens.shape == (0,) and tokens.dtype == torch.int64
    assert logps.shape == (0,) and logps.dtype == torch.float32
    assert fused_calls == []


def test_top_p_breaks_ties_by_vocabulary_index():
    # 64 equal logits: each probability is exactly 1/64, the mass before the i-th token in the
    # sort is i/64, so p = .5 keeps the first 32 of the sort: tokens 0..31 when ties are broken
    # by index. (An unstable sort may put any 32 of them first: the CPU's puts 32..63 there.)
    logits = torch.zeros(2, 64)
    got = filter_logits(logits, top_p_N=torch.tensor([0.5, 0.25]))
    assert torch.isfinite(got[0]).nonzero()[:, 0].tolist() == list(range(32))
    assert torch.isfinite(got[1]).nonzero()[:, 0].tolist() == list(range(16))
    # ties below a larger token: token 40 (mass 1/2, logit ln 63 against 63 ones of 0) first,
    # then the ties in index order, 1/126 each; p = 3/4 keeps 40 and the 32 ties (0..31) whose
    # mass before, 1/2 + j/126, is below 3/4 (j < 31.5)
    logits = torch.zeros(1, 64)
    logits[0, 40] = math.log(63.0)
    got = filter_logits(logits, top_p_N=torch.tensor([0.75]))[0]
    kept = torch.isfinite(got).nonzero()[:, 0].tolist()
    assert 40 in kept and len(kept) == 33
    assert kept == sorted([40, *range(32)])
