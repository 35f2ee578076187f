"""policy_loss at its edges: clamps, padding, empty batches, inclusive bounds, dtypes, the KL
term's aggregation, refusals; each case hand-computed. Written for the survivors of a mutation
run (docs/mutation/rl.grpo.md)."""

import math

import pytest
import torch

from mxrl.rl import policy_loss, zero_std_groups
from tests.rl.test_grpo import _one_token_each


def test_log_ratios_are_clamped_to_20_on_both_sides():
    """exp(clamp(logp - old_logp, -20, 20)): a log-ratio of +30 counts as +20 and -30 as -20
    (one token each, so neither side hides in the other's rounding)."""
    one = torch.ones(1, 1, dtype=torch.float64)
    # A = -1, log-ratio +30: l = -A * r = e^20 (the high side never clips for A < 0)
    loss, stats = policy_loss(one * 0, one * -30, -torch.ones(1, dtype=torch.float64), one)
    assert loss.item() == pytest.approx(math.exp(20), rel=1e-12)
    assert stats["ratio/max"] == pytest.approx(math.exp(20), rel=1e-12)
    # A = 1, log-ratio -30: l = -r = -e^-20 (the low side never clips for A > 0)
    loss, stats = policy_loss(one * 0, one * 30, torch.ones(1, dtype=torch.float64), one)
    assert loss.item() == pytest.approx(-math.exp(-20), rel=1e-12)
    assert stats["ratio/mean"] == pytest.approx(math.exp(-20), rel=1e-12)
    # rho = pi_old / mu clamped the same way: old - rollout = -30 -> w = e^-20
    kw = {"rollout_logp": one * 30, "correction": "tis"}
    loss, stats = policy_loss(one * 0, one * 0, torch.ones(1, dtype=torch.float64), one, **kw)
    assert loss.item() == pytest.approx(-math.exp(-20), rel=1e-12)
    assert stats["tis/rho_mean"] == pytest.approx(math.exp(-20), rel=1e-12)


def test_stats_ignore_padding_tokens():
    """One valid token of ratio 1.5 and two padding tokens (their ratio would be exp(0) = 1):
    every mean is over the valid token alone."""
    logp = torch.log(torch.tensor([[1.5, 1.0, 1.0]], dtype=torch.float64))
    mask = torch.tensor([[1, 0, 0]])
    kw = {"rollout_logp": torch.log(torch.tensor([[0.25, 1.0, 1.0]], dtype=torch.float64)),
          "correction": "tis"}  # fmt: skip
    loss, stats = policy_loss(
        logp, torch.zeros(1, 3, dtype=torch.float64), -torch.ones(1), mask, **kw
    )
    assert stats["ratio/mean"] == pytest.approx(1.5) and stats["ratio/max"] == pytest.approx(1.5)
    assert stats["tis/rho_mean"] == pytest.approx(4.0) and stats["tis/mean_weight"] == 2.0
    assert stats["loss/clip_frac"] == 0.0 and stats["loss/num_tokens"] == 1
    assert loss.item() == pytest.approx(2.0 * 1.5)  # w * -A * r over 1 token


def test_an_empty_batch_gives_zeros():
    z = torch.zeros(0, 4)
    loss, stats = policy_loss(z, z, torch.zeros(0), z, rollout_logp=z, correction="tis")
    assert loss.item() == 0.0
    assert stats["ratio/max"] == 0.0 and stats["tis/rho_max"] == 0.0
    assert stats["loss/num_tokens"] == 0.0


def test_sequence_mean_counts_sequences_with_tokens_and_takes_a_denominator():
    """Per-token loss -A at ratio 1: sequence 0 (1 token, A = 2) means -2, sequence 1 (3
    tokens, A = -1) means 1, sequence 2 has no token and does not count."""
    logp = torch.zeros(3, 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    adv = torch.tensor([2.0, -1.0, 5.0])
    agg = {"aggregation": "seq-mean-token-mean"}
    loss, _ = policy_loss(logp, logp, adv, mask, **agg)
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 2)
    loss, _ = policy_loss(logp, logp, adv, mask, denominator=4, **agg)
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 4)
    loss, _ = policy_loss(logp[:1], logp[:1], adv[:1], mask[:1], **agg)  # one sequence
    assert loss.item() == pytest.approx(-2.0)


def test_shape_and_range_refusals():
    z = torch.zeros(2, 3)
    for name in ("mask", "rollout_logp", "ref_logp"):
        kw = {"mask": z, "rollout_logp": z, "ref_logp": z, name: torch.zeros(2, 4)}
        mask = kw.pop("mask")
        with pytest.raises(ValueError, match=f"{name} has shape"):
            policy_loss(z, z, torch.zeros(2), mask, **kw)
    with pytest.raises(ValueError, match=r"logp must be \[B, T\]"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3))
    for eps_low, eps_high in ((1.0, 0.28), (1.5, 0.28), (-0.1, 0.28), (0.2, -0.01)):
        with pytest.raises(ValueError, match="eps_low"):
            policy_loss(z, z, torch.zeros(2), z, eps_low=eps_low, eps_high=eps_high)
    loss, _ = policy_loss(z, z, torch.zeros(2), z, eps_low=0.0, eps_high=0.0)  # no clip room
    assert loss.item() == 0.0
    with pytest.raises(ValueError, match="mis_low < tis_cap"):
        policy_loss(z, z, torch.zeros(2), z, rollout_logp=z, correction="tis", mis_low=2.0)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(z, z, torch.zeros(2), z, dual_clip=1.0)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(z, z, torch.zeros(2), z, aggregation="sum")


def test_zero_std_groups_refuses_what_does_not_split():
    for rewards, size in ((torch.zeros(2, 2), 2), (torch.zeros(4), 0), (torch.zeros(6), 4)):
        with pytest.raises(ValueError, match="do not split"):
            zero_std_groups(rewards, size)
    assert zero_std_groups(torch.tensor([1.0, 0.0]), 1).tolist() == [True, True]
    assert zero_std_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2).tolist() == [True, False]


def test_loss_dtype_is_logps_at_least_fp32():
    """The loss has logp's dtype, at least fp32: bf16 logp computes in fp32; fp64 advantages,
    a fp64 rollout, a global denominator do not widen a fp32 loss; fp64 logp stays fp64 (and a
    denominator past 2^24, which is no float32, stays exact)."""
    m = torch.ones(2, 3)
    bf16 = torch.full((2, 3), -1.0, dtype=torch.bfloat16)
    loss, _ = policy_loss(bf16, bf16, torch.ones(2, dtype=torch.bfloat16), m)
    assert loss.dtype == torch.float32 and loss.item() == -1.0
    f32 = torch.full((2, 3), -1.0)
    kw = {"rollout_logp": f32.double() - 0.25, "correction": "tis"}
    seq = {"denominator": 7, "aggregation": "seq-mean-token-mean"}
    for extra in ({"denominator": 7}, seq, kw):
        loss, _ = policy_loss(f32, f32, torch.ones(2, dtype=torch.float64), m, **extra)
        assert loss.dtype == torch.float32, extra
    f64 = torch.full((2, 3), -1.0, dtype=torch.float64)
    n = 2**24 + 1  # not a float32
    for agg in ("token-mean", "seq-mean-token-mean"):
        loss, _ = policy_loss(f64, f64, torch.ones(2, dtype=torch.float64), m, denominator=n,
                              aggregation=agg)  # fmt: skip
        assert loss.dtype == torch.float64
        assert loss.item() == -(6.0 if agg == "token-mean" else 2.0) / n  # exact in fp64


def test_dual_clip_bound_and_positive_advantages():
    out, _, _ = _one_token_each([5.0], [0.5], dual_clip=3.0)  # A > 0: clip-higher only
    assert out.item() == pytest.approx(-0.5 * 1.28)
    out, _, _ = _one_token_each([5.0], [-1.0], dual_clip=1.5)  # any c > 1 is accepted
    assert out.item() == pytest.approx(1.5)


def test_clip_sides_follow_the_sign_of_a_fractional_advantage():
    _, stats, _ = _one_token_each([1.5, 0.5], [0.5, -0.5])
    assert stats["loss/clip_frac_high"] == 0.5 and stats["loss/clip_frac_low"] == 0.5


def test_the_cap_and_mis_low_are_inclusive_bounds():
    """rho exactly at the cap is not clipped (TIS) or dropped (MIS); exactly at mis_low kept."""
    z = torch.zeros(1, 1)  # rho = exp(0) = 1 exactly
    base = (z, z, torch.ones(1), torch.ones(1, 1))
    _, stats = policy_loss(*base, rollout_logp=z, correction="tis", tis_cap=1.0)
    assert stats["tis/clipped_frac"] == 0.0
    _, stats = policy_loss(*base, rollout_logp=z, correction="mis", tis_cap=1.0)
    assert stats["mis/masked_frac"] == 0.0 and stats["tis/mean_weight"] == 1.0
    _, stats = policy_loss(*base, rollout_logp=z, correction="mis", mis_low=1.0)
    assert stats["mis/masked_frac"] == 0.0


def test_kl_is_capped_aggregated_like_the_loss_and_added_at_any_coefficient():
    """k3 at ref - logp = 5 is e^5 - 6 = 142.4, capped at 10; with ref - logp = ln 2 it is
    1 - ln 2 (k3 of test_k3_kl_to_a_reference). Sequences of 1 and 3 tokens: token-mean weighs
    tokens, seq-mean-token-mean sequences; a denominator replaces the count."""
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    ref = torch.tensor([[5.0, 0.0, 0.0], [math.log(2)] * 3])
    k3 = 2.0 - math.log(2.0) - 1.0
    kw = {"ref_logp": ref, "kl_coef": 1.0}
    loss, stats = policy_loss(logp, logp, torch.zeros(2), mask, **kw)
    assert stats["loss/kl"] == pytest.approx((10.0 + 3 * k3) / 4)
    assert loss.item() == pytest.approx(stats["loss/kl"])  # kl_coef 1 adds it whole
    assert stats["loss/pg"] == 0.0
    _, stats = policy_loss(logp, logp, torch.zeros(2), mask, denominator=8, **kw)
    assert stats["loss/kl"] == pytest.approx((10.0 + 3 * k3) / 8)
    _, stats = policy_loss(logp, logp, torch.zeros(2), mask, aggregation="seq-mean-token-mean",
                           **kw)  # fmt: skip
    assert stats["loss/kl"] == pytest.approx((10.0 + k3) / 2)


def test_pg_loss_is_reported_apart_from_the_kl():
    logp = torch.zeros(1, 2)
    ref = torch.full((1, 2), math.log(2.0))
    loss, stats = policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2), ref_logp=ref,
                              kl_coef=0.5)  # fmt: skip
    assert stats["loss/pg"] == -1.0 and stats["loss/total"] == pytest.approx(loss.item())
    assert loss.item() == pytest.approx(-1.0 + 0.5 * (1.0 - math.log(2.0)))


@pytest.mark.gpu
def test_policy_loss_on_cuda_equals_the_cpu():
    g = torch.Generator().manual_seed(3)
    logp, old, rollout, ref = (torch.randn(4, 6, generator=g) * 0.3 - 1 for _ in range(4))
    adv = torch.randn(4, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.2).float()
    kw = {"correction": "tis", "kl_coef": 0.1}
    cpu, cpu_stats = policy_loss(logp, old, adv, mask, rollout_logp=rollout, ref_logp=ref, **kw)
    on = [t.cuda() for t in (logp, old, adv, mask, rollout, ref)]
    gpu, gpu_stats = policy_loss(*on[:4], rollout_logp=on[4], ref_logp=on[5], **kw)
    assert gpu.device.type == "cuda"
    assert gpu.item() == pytest.approx(cpu.item(), rel=1e-5)
    assert gpu_stats == pytest.approx(cpu_stats, rel=1e-5)
