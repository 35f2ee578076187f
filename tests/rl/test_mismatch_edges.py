"""Edge cases of mxrl/rl/mismatch.py that its mutation run (docs/mutation/rl.mismatch.md) found
untested: per-sequence values of more than one non-empty sequence (k3, |d| mean and max), a
sequence of one token, a batch of one token, a batch without a valid token, a batch without
sequences. Every expectation is worked out by hand from the module docstring's formulas
(d = train - rollout; k1 = mean(-d), k3 = mean(exp(d) - 1 - d), over valid tokens)."""

from __future__ import annotations

import math

import pytest
import torch

from mxrl.rl import mismatch_metrics


def _k3(d: float) -> float:
    return math.expm1(d) - d


def test_two_sequences_with_padding_that_holds_large_values():
    # d = train - rollout: sequence 0 has [0.5, -0.25] (one pad), sequence 1 has [1.0] (two
    # pads). The pads hold 9.0: any of them counted would move every number below
    rollout = torch.zeros(2, 3)
    train = torch.tensor([[0.5, -0.25, 9.0], [1.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = mismatch_metrics(rollout, train, mask)

    assert m.num_tokens == 3
    assert m.k1 == pytest.approx(-(0.5 - 0.25 + 1.0) / 3, rel=1e-12)
    assert m.k3 == pytest.approx((_k3(0.5) + _k3(-0.25) + _k3(1.0)) / 3, rel=1e-12)
    assert m.logp_abs_diff_mean == pytest.approx((0.5 + 0.25 + 1.0) / 3, rel=1e-12)
    assert m.logp_abs_diff_max == 1.0

    def close(t, expected):
        assert t.dtype == torch.float32 and t.shape == (2,)
        assert t.tolist() == pytest.approx(expected, rel=1e-6)

    close(m.seq_k1, [-(0.5 - 0.25) / 2, -1.0])  # a sequence of one token: its own d
    close(m.seq_k3, [(_k3(0.5) + _k3(-0.25)) / 2, _k3(1.0)])
    close(m.seq_abs_diff_mean, [(0.5 + 0.25) / 2, 1.0])
    close(m.seq_abs_diff_max, [0.5, 1.0])  # each sequence's own max, below 1 for the first


def test_the_max_is_of_magnitudes_and_per_sequence():
    # negative log-ratios only: max |d| is the most negative d's magnitude
    rollout = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    train = torch.tensor([[-0.75, -0.125], [-0.25, 0.0]])
    m = mismatch_metrics(rollout, train, torch.ones(2, 2, dtype=torch.bool))
    assert m.logp_abs_diff_max == 0.75
    assert m.seq_abs_diff_max.tolist() == [0.75, 0.25]


def test_a_batch_of_one_token_divides_by_one():
    rollout = torch.tensor([[-1.0, -2.0]])
    train = torch.tensor([[-0.5, 3.0]])
    m = mismatch_metrics(rollout, train, torch.tensor([[1, 0]]))
    assert m.num_tokens == 1
    assert m.k1 == pytest.approx(-0.5, rel=1e-12)
    assert m.k3 == pytest.approx(_k3(0.5), rel=1e-12)
    assert m.logp_abs_diff_mean == pytest.approx(0.5, rel=1e-12)
    assert m.logp_abs_diff_max == 0.5


def test_a_batch_without_a_valid_token_is_all_zero_and_nan_per_sequence():
    rollout = torch.full((2, 3), -1.0)
    train = torch.full((2, 3), 7.0)  # would be d = 8 everywhere, were a token valid
    m = mismatch_metrics(rollout, train, torch.zeros(2, 3))
    assert m.num_tokens == 0
    assert (m.k1, m.k3, m.logp_abs_diff_mean, m.logp_abs_diff_max) == (0.0, 0.0, 0.0, 0.0)
    for t in (m.seq_k1, m.seq_k3, m.seq_abs_diff_mean, m.seq_abs_diff_max):
        assert t.shape == (2,) and torch.isnan(t).all()


def test_a_batch_without_sequences():
    # a train rank that holds no sequence this step: nothing to measure, no error
    empty = torch.zeros(0, 4)
    m = mismatch_metrics(empty, empty.clone(), torch.zeros(0, 4))
    assert m.num_tokens == 0
    assert (m.k1, m.k3, m.logp_abs_diff_mean, m.logp_abs_diff_max) == (0.0, 0.0, 0.0, 0.0)
    for t in (m.seq_k1, m.seq_k3, m.seq_abs_diff_mean, m.seq_abs_diff_max):
        assert t.shape == (0,)
