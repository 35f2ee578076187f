"""mismatch_metrics on values worked out by hand."""

import math

import pytest
import torch

from mxrl.rl import mismatch_metrics


def test_identical_logprobs_give_zero():
    lp = torch.log(torch.rand(3, 5))
    m = mismatch_metrics(lp, lp.clone(), torch.ones(3, 5))
    assert m.k1 == 0 and m.k3 == 0 and m.logp_abs_diff_max == 0 and m.num_tokens == 15


def test_constant_log_ratio():
    rollout = torch.full((2, 4), -1.0)
    delta = 0.1  # train = rollout + delta on every token
    m = mismatch_metrics(rollout, rollout + delta, torch.ones(2, 4))
    assert m.k1 == pytest.approx(-delta)
    assert m.k3 == pytest.approx(math.exp(delta) - 1 - delta)
    assert m.logp_abs_diff_mean == pytest.approx(delta) and m.logp_abs_diff_max == pytest.approx(
        delta
    )


def test_mask_excludes_padding_and_per_sequence_values():
    rollout = torch.zeros(2, 3)
    train = torch.tensor([[0.2, 0.4, 9.0], [0.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    m = mismatch_metrics(rollout, train, mask)
    assert m.num_tokens == 2
    assert m.logp_abs_diff_mean == pytest.approx(0.3) and m.logp_abs_diff_max == pytest.approx(0.4)
    assert m.seq_k1[0].item() == pytest.approx(-0.3) and math.isnan(m.seq_k1[1].item())
    assert m.as_dict()["mismatch/k3"] == m.k3


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="pad all three"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
