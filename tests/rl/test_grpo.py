"""group_advantages and policy_loss on values worked out by hand."""

import math

import pytest
import torch

from mxrl.rl import group_advantages, policy_loss, zero_std_groups

# --- advantages ---------------------------------------------------------------------------------


def test_group_advantages_unbiased_std():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, 4)
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    expect = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert a[:4].tolist() == pytest.approx([expect, -expect, -expect, expect], rel=1e-6)
    assert a[4:].tolist() == [0.0] * 4  # all-equal group: no signal
    assert a.dtype == torch.float32
    assert zero_std_groups(r, 4).tolist() == [False, True]


def test_dr_grpo_drops_the_std():
    r = torch.tensor([3.0, 1.0, 2.0, 2.0])
    assert group_advantages(r, 2, std_normalize=False).tolist() == [1.0, -1.0, 0.0, 0.0]


def test_group_of_one_follows_verl():
    r = torch.tensor([1.0, 0.0])
    assert group_advantages(r, 1).tolist() == pytest.approx([1 / (1 + 1e-6), 0.0])
    assert group_advantages(r, 1, std_normalize=False).tolist() == [1.0, 0.0]


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="does not divide"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError) as err:
        group_advantages(torch.tensor([0.0, 1.0, 1.0, float("nan"), float("inf"), 0.0]), 2)
    assert str(err.value) == (
        "2 of 6 rewards are not finite; the first is reward 3 (prompt 1, sample 1) = nan. "
        "A reward function must return a finite number for every sample: return 0.0 (or "
        "another finite penalty) for an answer it cannot parse or score, not NaN or Inf."
    )
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)


# --- policy loss --------------------------------------------------------------------------------


def _one_token_each(ratios, advantages, **kw):
    """B sequences of one token each, old_logp = 0, logp = log(ratio)."""
    logp = torch.log(torch.tensor(ratios, dtype=torch.float64))[:, None].requires_grad_()
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    loss, stats = policy_loss(logp, old, torch.tensor(advantages, dtype=torch.float64), mask, **kw)
    loss.backward()
    return loss, stats, logp.grad[:, 0]


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad", "clipped"),
    [
        (1.1, 1.0, -1.1, -1.1, False),  # inside [0.8, 1.28]
        (1.5, 1.0, -1.28, 0.0, True),  # clip-higher: A > 0 above 1 + eps_high
        (1.5, -1.0, 1.5, 1.5, False),  # A < 0: the high side never clips
        (0.5, -1.0, 0.8, 0.0, True),  # A < 0 below 1 - eps_low
        (0.5, 1.0, -0.5, -0.5, False),  # A > 0: the low side never clips
        (1.25, 1.0, -1.25, -1.25, False),  # would clip at symmetric 0.2, not at 0.28
    ],
)
def test_clip_on_both_sides(ratio, adv, loss, grad, clipped):
    out, stats, g = _one_token_each([ratio], [adv])
    assert out.item() == pytest.approx(loss)
    assert g.item() == pytest.approx(grad)  # d/dlogp of -A r = -A r
    assert stats["loss/clip_frac"] == float(clipped)
    side = "loss/clip_frac_high" if adv > 0 else "loss/clip_frac_low"
    assert stats[side] == float(clipped)


def test_clip_fraction_and_ratio_stats_over_a_batch():
    _, stats, _ = _one_token_each([1.5, 0.5, 1.0, 1.1], [1.0, -1.0, 1.0, -1.0])
    assert stats["loss/clip_frac"] == 0.5
    assert stats["loss/clip_frac_high"] == 0.25 and stats["loss/clip_frac_low"] == 0.25
    assert stats["ratio/max"] == pytest.approx(1.5)
    assert stats["ratio/mean"] == pytest.approx((1.5 + 0.5 + 1.0 + 1.1) / 4)
    assert stats["loss/num_tokens"] == 4


def test_dual_clip_bounds_negative_advantages():
    out, _, g = _one_token_each([5.0], [-1.0], dual_clip=3.0)
    assert out.item() == pytest.approx(3.0) and g.item() == 0.0
    out, _, _ = _one_token_each([5.0], [-1.0])
    assert out.item() == pytest.approx(5.0)


def test_token_level_vs_sequence_level_aggregation():
    # ratio 1 everywhere, so each valid token's loss is -A: seq 0 has 1 token (A=1),
    # seq 1 has 3 tokens (A=-1); padding carries garbage that must not count.
    logp = torch.tensor([[0.0, 9.0, 9.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    tok, stats = policy_loss(logp, torch.zeros(2, 3), adv, mask)
    assert tok.item() == pytest.approx((-1 + 3) / 4)  # DAPO: every token weighs the same
    assert stats["ratio/max"] == 1.0
    seq, _ = policy_loss(logp, torch.zeros(2, 3), adv, mask, aggregation="seq-mean-token-mean")
    assert seq.item() == pytest.approx((-1 + 1) / 2)  # GRPO: every sequence weighs the same


def test_micro_batches_with_a_global_denominator_match_the_full_batch():
    torch.manual_seed(0)
    logp = (torch.randn(4, 5) * 0.1).requires_grad_()
    old = logp.detach() + torch.randn(4, 5) * 0.1
    adv = torch.randn(4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    full, _ = policy_loss(logp, old, adv, mask)
    (g_full,) = torch.autograd.grad(full, logp)
    n = float(mask.sum())
    halves = (slice(0, 2), slice(2, 4))
    total = sum(policy_loss(logp[s], old[s], adv[s], mask[s], denominator=n)[0] for s in halves)
    (g_parts,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(full.item(), rel=1e-6)
    torch.testing.assert_close(g_parts, g_full)


def test_tis_truncates_the_weight():
    # pi_old / mu = 4 (capped to 2) and 0.5; ratio pi/pi_old = 1, A = 1 -> l = -w
    old = torch.zeros(2, 1)
    rollout = torch.log(torch.tensor([[0.25], [2.0]]))
    loss, stats = policy_loss(
        old.clone(), old, torch.ones(2), torch.ones(2, 1), rollout_logp=rollout, correction="tis"
    )
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert stats["tis/mean_weight"] == pytest.approx(1.25)
    assert stats["tis/clipped_frac"] == 0.5 and stats["mis/masked_frac"] == 0.0
    assert stats["tis/rho_max"] == pytest.approx(4.0)


def test_tis_leaves_ratios_below_one_over_the_cap_alone():
    """TIS truncates from above only: rho = pi_old / mu of 0.01, 0.1, 0.3 (all far below
    1 / C = 0.5) weigh the loss by themselves; 3 is cut to C = 2. Ratio pi / pi_old = 1 and
    A = 1, so each token's loss is -w and its gradient -w."""
    rho = [0.01, 0.1, 0.3, 3.0]
    logp = torch.zeros(4, 1, dtype=torch.float64, requires_grad=True)
    rollout = -torch.log(torch.tensor(rho, dtype=torch.float64))[:, None]  # old_logp = 0
    loss, stats = policy_loss(
        logp, torch.zeros(4, 1, dtype=torch.float64), torch.ones(4, dtype=torch.float64),
        torch.ones(4, 1), rollout_logp=rollout, correction="tis",
    )  # fmt: skip
    loss.backward()
    w = [0.01, 0.1, 0.3, 2.0]
    assert loss.item() == pytest.approx(-sum(w) / 4, rel=1e-12)
    assert logp.grad[:, 0].tolist() == pytest.approx([-x / 4 for x in w], rel=1e-12)
    assert stats["tis/mean_weight"] == pytest.approx(sum(w) / 4, rel=1e-12)
    assert stats["tis/clipped_frac"] == 0.25 and stats["tis/rho_max"] == pytest.approx(3.0)
    assert stats["tis/rho_mean"] == pytest.approx(sum(rho) / 4, rel=1e-12)


def test_mis_drops_tokens_over_the_cap_and_keeps_the_denominator():
    old = torch.zeros(2, 1)
    rollout = torch.log(torch.tensor([[0.25], [2.0]]))  # rho = 4 (dropped), 0.5 (kept)
    kw = {"rollout_logp": rollout, "correction": "mis"}
    loss, stats = policy_loss(old.clone(), old, torch.ones(2), torch.ones(2, 1), **kw)
    assert loss.item() == pytest.approx(-0.5 / 2)
    assert stats["mis/masked_frac"] == 0.5 and stats["tis/mean_weight"] == pytest.approx(0.25)
    # IcePop-style lower bound: 0.5 < mis_low drops the other token too
    loss, stats = policy_loss(old.clone(), old, torch.ones(2), torch.ones(2, 1), mis_low=0.6, **kw)
    assert loss.item() == 0.0 and stats["mis/masked_frac"] == 1.0


def test_correction_weight_is_detached():
    logp = torch.zeros(1, 1, requires_grad=True)
    old = torch.zeros(1, 1)
    rollout = torch.full((1, 1), math.log(0.5))  # rho = 2 -> w = 2
    kw = {"rollout_logp": rollout, "correction": "tis", "tis_cap": 3.0}
    loss, _ = policy_loss(logp, old, torch.ones(1), torch.ones(1, 1), **kw)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-2.0)  # w * d(-A r)/dlogp, no gradient through w


def test_gradient_sign_follows_the_advantage():
    torch.manual_seed(1)
    old = torch.randn(2, 6) * 0.01
    logp = old.clone().requires_grad_()
    loss, _ = policy_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 6))
    loss.backward()
    step = -logp.grad  # gradient descent direction
    assert (step[0] > 0).all() and (step[1] < 0).all()


def test_k3_kl_to_a_reference():
    logp = torch.zeros(1, 2)
    ref = torch.full((1, 2), math.log(2.0))
    k3 = 2.0 - math.log(2.0) - 1.0
    loss, stats = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), ref_logp=ref)
    assert loss.item() == 0.0 and stats["loss/kl"] == pytest.approx(k3)  # logged, not applied
    loss, stats = policy_loss(
        logp, logp, torch.zeros(1), torch.ones(1, 2), ref_logp=ref, kl_coef=0.1
    )
    assert loss.item() == pytest.approx(0.1 * k3) and stats["loss/total"] == loss.item()


def test_empty_mask_gives_zero_loss_with_a_graph():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = policy_loss(logp, logp.detach(), torch.ones(2), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and stats["loss/clip_frac"] == 0.0 and stats["ratio/max"] == 0.0


def test_policy_loss_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logp has shape"):
        policy_loss(z, torch.zeros(2, 4), torch.zeros(2), z)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(z, z, torch.zeros(3), z)
    with pytest.raises(ValueError, match="needs rollout_logp"):
        policy_loss(z, z, torch.zeros(2), z, correction="tis")
    with pytest.raises(ValueError, match="needs ref_logp"):
        policy_loss(z, z, torch.zeros(2), z, kl_coef=0.1)
    with pytest.raises(ValueError, match="correction must be"):
        policy_loss(z, z, torch.zeros(2), z, rollout_logp=z, correction="seq")


def test_padding_may_hold_nan_and_inf():
    logp = torch.tensor([[-1.0, float("nan")], [-0.5, -float("inf")]], requires_grad=True)
    old = torch.tensor([[-1.0, -float("inf")], [-0.5, float("nan")]])
    mask = torch.tensor([[1, 0], [1, 0]])
    kw = {"rollout_logp": old, "correction": "mis", "ref_logp": old}
    loss, stats = policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask, **kw)
    loss.backward()
    assert loss.item() == 0.0 and all(math.isfinite(v) for v in stats.values())
    assert torch.isfinite(logp.grad).all() and logp.grad[:, 1].eq(0).all()
