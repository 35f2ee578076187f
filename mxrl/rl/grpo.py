"""GRPO / DAPO building blocks on padded tensors: group advantages and the clipped policy loss
with rollout correction (TIS / MIS) and an optional KL term (docs/design.md §8).

Every formula follows `background/rl_frameworks.md` §2, which records how verl, slime, TRL and
OpenRLHF implement them; the section is cited beside each piece.

Legend: B sequences (prompts x samples, the samples of one prompt contiguous), T padded
response length. `mask` [B, T] is 1/True on response tokens, 0/False on padding. Log-probs are
of the sampled tokens: `logp` under the policy being trained (pi_theta, carries the gradient),
`old_logp` under the trainer's policy before this update (pi_old, recomputed by the trainer),
`rollout_logp` under the rollout engine's policy (mu, as sampled), `ref_logp` under a frozen
reference. Everything except `logp` is treated as a constant (detached).

`policy_loss`, per valid token t of sequence i (rl_frameworks.md §2.2):
  r_t   = exp(clamp(logp - old_logp, -20, 20))
  l_t   = -min(r_t * A_i, clip(r_t, 1 - eps_low, 1 + eps_high) * A_i)
clip is active on a token when the clipped term is the one selected and differs, i.e.
r_t > 1 + eps_high with A > 0, or r_t < 1 - eps_low with A < 0 (verl's pg_clipfrac).
dual_clip=c (off by default; verl clip_ratio_c = 3) bounds the loss of A < 0 tokens by
-c * A, i.e. l_t = min(l_t, -c * A) when A < 0.

Rollout correction (rl_frameworks.md §2.3, §2.4), with rho_t = exp(old_logp - rollout_logp)
(pi_old / mu, log-ratio clamped to +-20); the weight w_t is detached and multiplies l_t:
  "tis": w_t = min(rho_t, tis_cap)                       token TIS (Yao et al.; verl, slime C=2)
  "mis": w_t = rho_t * 1[mis_low <= rho_t <= tis_cap]    token masked IS: a token whose ratio
         exceeds the cap (or falls below mis_low) is dropped, a kept token keeps its
         untruncated weight (TRL `token_mask`; with mis_low=0.5, tis_cap=5 this is IcePop).
A dropped token still counts in the denominator (as in TRL, where the weights multiply the
per-token loss before the division by the batch's token count), so dropping tokens never
scales up the gradient of the others and a precomputed global `denominator` stays valid.
Bypass mode (no recomputed pi_old) is the caller's choice: pass old_logp = rollout_logp and
no correction.

KL to a reference (off by default; rl_frameworks.md §2.5, verl `low_var_kl`/k3):
  kl_t = clamp(exp(ref - logp) - (ref - logp) - 1, -10, 10), ref - logp clamped to +-20,
added as kl_coef * agg(kl_t), unweighted by the correction. Computed for the stats whenever
ref_logp is given.

Aggregation:
  "token-mean" (DAPO, verl default): sum_{i,t} w_t l_t m_t / sum_{i,t} m_t
  "seq-mean-token-mean" (original GRPO): mean over sequences with >= 1 valid token of
  sum_t w_t l_t m_t / sum_t m_t.
`denominator` replaces the count in the outer division (tokens for token-mean, sequences
for seq-mean-token-mean): pass the whole optimizer batch's count when this call sees one
micro-batch, so summed micro-batch losses equal the full-batch loss (verl's
batch_num_tokens).

Stats (python floats over this call's valid tokens), in this order: with a correction first
tis/mean_weight (mean w_t), tis/clipped_frac (tokens with rho_t > tis_cap), mis/masked_frac
(tokens dropped by "mis", 0 under "tis"), tis/rho_mean, tis/rho_max; then loss/pg, loss/kl,
loss/total, loss/clip_frac, loss/clip_frac_low, loss/clip_frac_high, loss/num_tokens,
ratio/mean, ratio/max (r_t).
"""

from __future__ import annotations

import torch

from mxrl.rl.choices import Aggregation, Correction

# verl and OpenRLHF clamp log-ratios to +-20 before exp (rl_frameworks.md §2.2, §2.3): a
# ratio of e^20 is already meaningless and e^89 overflows fp32.
LOG_RATIO_CLAMP = 20.0
# verl's k3 KL penalty clamps each token's value to +-10 (rl_frameworks.md §2.5).
KL_CLAMP = 10.0
F64 = torch.float64


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantages, one per sequence: float32 [B].

    A_i = (r_i - mean_g) / (std_g + eps)   over the group g of `group_size` samples of one
    prompt (rows g*n .. g*n+n-1 of `rewards`); std_normalize=False gives Dr.GRPO's
    A_i = r_i - mean_g (arXiv 2503.20783).

    std_g is the unbiased (Bessel-corrected, n-1) standard deviation, and eps = 1e-6, as in
    verl `compute_grpo_outcome_advantage` (torch.std) and slime `_post_process_rewards`
    (rl_frameworks.md §2.1). A group whose rewards are all equal gets A = 0 for every sample
    (no learning signal; DAPO's dynamic sampling drops such groups, see `zero_std_groups`).
    A group of one sample has no std: as verl, it gets mean 0 and std 1, so A = r / (1 + eps)
    when std_normalize (REINFORCE without a baseline) and A = r otherwise.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide the {rewards.numel()} rewards; pass "
            "prompts x samples_per_prompt rewards with each prompt's samples contiguous"
        )
    r = rewards.detach().double()
    bad = ~torch.isfinite(r)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"{int(bad.sum())} of {r.numel()} rewards are not finite; the first is reward {i} "
            f"(prompt {i // group_size}, sample {i % group_size}) = {r[i].item()}. A reward "
            "function must return a finite number for every sample: return 0.0 (or another "
            "finite penalty) for an answer it cannot parse or score, not NaN or Inf."
        )
    g = r.view(-1, group_size)
    if group_size == 1:
        mean, std = torch.zeros_like(g), torch.ones_like(g)
    else:
        mean, std = g.mean(-1, keepdim=True), g.std(-1, keepdim=True)  # unbiased
    adv = g - mean
    if std_normalize:
        adv = adv / (std + eps)
    return adv.view(-1).float()


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [B / group_size]: groups whose rewards are all equal (all advantages 0). DAPO's
    dynamic sampling keeps only groups with 0 < #correct < n (rl_frameworks.md §2.2)."""
    if rewards.ndim != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} do not split into groups of {group_size}")
    g = rewards.detach().view(-1, group_size)
    return (g == g[:, :1]).all(-1)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    rollout_logp: torch.Tensor | None = None,
    correction: Correction | None = None,
    tis_cap: float = 2.0,
    mis_low: float = 0.0,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    aggregation: Aggregation = Aggregation.TOKEN_MEAN,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip policy loss, DAPO's clip-higher, rollout correction (TIS / MIS) and KL penalty:
    (loss scalar, stats). The formulas, `denominator` and the stats: the module docstring."""
    _check_loss_args(
        logp,
        old_logp,
        advantages,
        mask,
        rollout_logp,
        ref_logp,
        eps_low,
        eps_high,
        correction,
        tis_cap,
        mis_low,
        dual_clip,
        kl_coef,
        aggregation,
    )
    # fp32 at least: a bf16 sum over thousands of tokens would lose the loss's low bits.
    logp = logp.to(torch.promote_types(logp.dtype, torch.float32))
    m = mask.to(torch.bool)
    mf = m.to(logp.dtype)
    adv = advantages.detach().to(logp.dtype)[:, None]
    # Padding may hold anything (-inf, NaN): zero its log-ratios so 0 * NaN never reaches a sum.
    ratio = torch.exp(_log_ratio(logp, old_logp.detach(), m))
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(surr, surr_clipped)
    clipped = (surr_clipped > surr) & m
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    # Stats are gathered as 0-d tensors and read back with one device sync at the end.
    stats: dict[str, torch.Tensor] = {}
    if correction is not None:
        pg, stats = _rollout_correction(
            pg, old_logp, rollout_logp, m, mf, correction, tis_cap, mis_low, logp.dtype
        )

    pg_loss = _aggregate(pg, mf, aggregation, denominator)
    loss = pg_loss
    kl_loss = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None:
        d = _log_ratio(ref_logp.detach(), logp, m)
        kl = (torch.exp(d) - d - 1.0).clamp(-KL_CLAMP, KL_CLAMP)
        kl_loss = _aggregate(kl, mf, aggregation, denominator)
        if kl_coef != 0.0:
            loss = loss + kl_coef * kl_loss
    low = clipped & (adv < 0)
    stats |= {
        "loss/pg": pg_loss,
        "loss/kl": kl_loss,
        "loss/total": loss,
        "loss/clip_frac": _masked_mean(clipped, mf),
        "loss/clip_frac_low": _masked_mean(low, mf),
        "loss/clip_frac_high": _masked_mean(clipped & ~low, mf),
        "loss/num_tokens": mf.sum(),
        "ratio/mean": _masked_mean(ratio, mf),
        "ratio/max": _masked_max(ratio, m),
    }
    values = torch.stack([v.detach().double().reshape(()) for v in stats.values()]).tolist()
    return loss, dict(zip(stats, values, strict=True))


def _check_loss_args(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rollout_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    eps_low: float,
    eps_high: float,
    correction: Correction | None,
    tis_cap: float,
    mis_low: float,
    dual_clip: float | None,
    kl_coef: float,
    aggregation: Aggregation,
) -> None:
    """The refusals of `policy_loss`, in the order it makes them."""
    _check_shapes(logp, old_logp=old_logp, mask=mask, rollout_logp=rollout_logp, ref_logp=ref_logp)
    if advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"advantages must be [B] = [{logp.shape[0]}], got {tuple(advantages.shape)}"
        )
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if correction not in (None, *Correction):
        raise ValueError(f"correction must be None, 'tis' or 'mis', got {correction!r}")
    if correction is not None and rollout_logp is None:
        raise ValueError(
            f"correction={str(correction)!r} needs rollout_logp (the engine's logprobs)"
        )
    if correction is not None and not 0 <= mis_low < tis_cap:
        raise ValueError(f"need 0 <= mis_low < tis_cap, got mis_low={mis_low}, tis_cap={tis_cap}")
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logp (the reference policy's logprobs)")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (verl uses 3.0), got {dual_clip}")
    if aggregation not in tuple(Aggregation):
        raise ValueError(
            f"aggregation must be 'token-mean' or 'seq-mean-token-mean', got {aggregation!r}"
        )


def _rollout_correction(
    pg: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor | None,
    m: torch.Tensor,
    mf: torch.Tensor,
    correction: Correction,
    tis_cap: float,
    mis_low: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pg weighted by the detached w_t of `correction` (module docstring), and the correction's
    stats as 0-d tensors, in their order."""
    assert rollout_logp is not None
    rho = torch.exp(_log_ratio(old_logp.detach(), rollout_logp.detach(), m))
    over = (rho > tis_cap) & m
    if correction == Correction.TIS:
        w = rho.clamp(max=tis_cap)
        dropped = torch.zeros_like(m)
    else:
        dropped = ((rho > tis_cap) | (rho < mis_low)) & m
        w = torch.where(dropped, torch.zeros_like(rho), rho)
    w = w.to(dtype).detach()
    pg = pg * w
    stats = {
        "tis/mean_weight": _masked_mean(w, mf),
        "tis/clipped_frac": _masked_mean(over, mf),
        "mis/masked_frac": _masked_mean(dropped, mf),
        "tis/rho_mean": _masked_mean(rho, mf),
        "tis/rho_max": _masked_max(rho, m),
    }
    return pg, stats


def _log_ratio(num: torch.Tensor, den: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """clamp(num - den, -20, 20) on valid tokens, 0 on padding."""
    d = torch.where(m, num - den, torch.zeros((), dtype=num.dtype, device=num.device))
    return d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _aggregate(
    x: torch.Tensor, mf: torch.Tensor, aggregation: Aggregation, denominator: float | None
) -> torch.Tensor:
    # a global denominator in float64: a token count past 2^24 is no float32 (it was rounded)
    if aggregation == Aggregation.TOKEN_MEAN:
        count = mf.sum() if denominator is None else torch.tensor(float(denominator), dtype=F64)
        return (x * mf).sum() / count.to(x).clamp(min=1.0)
    per_seq_tokens = mf.sum(-1)
    seq_mean = (x * mf).sum(-1) / per_seq_tokens.clamp(min=1.0)
    if denominator is None:
        count = (per_seq_tokens > 0).sum()
    else:
        count = torch.tensor(float(denominator), dtype=F64)
    return seq_mean.sum() / count.to(x).clamp(min=1.0)


def _masked_mean(x: torch.Tensor, mf: torch.Tensor) -> torch.Tensor:
    """Mean over valid tokens (0 when there is none); x is finite on valid tokens."""
    x = x.detach().double()
    return torch.where(mf > 0, x, 0.0).sum() / mf.sum().double().clamp(min=1.0)


def _masked_max(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Max over valid tokens (0 when there is none)."""
    return torch.where(m, x.detach().double(), 0.0).amax() if m.numel() else x.new_zeros(())


def _check_shapes(logp: torch.Tensor, **others: torch.Tensor | None) -> None:
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but logp has {tuple(logp.shape)}; pad every "
                "per-token tensor to the same [B, T]"
            )
