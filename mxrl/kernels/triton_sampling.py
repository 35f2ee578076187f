"""Sampling one token per row: the Triton kernels behind `mxrl.kernels.sampling.sample_rows`
(temperature only: no top-k / top-p filter).

A row's logits are cut into parts of BLOCK tokens (BLOCK fixed by the vocabulary size alone),
one program per (row, part), in three launches:
1. `sample_partials_kernel`: each part's max of `logit / T` and its sum of `exp(x - max)`;
2. `sample_race_kernel`: each program joins the row's partials into the log-sum-exp (every
   program of a row computes the same value: same inputs, same reduction), then runs the
   exponential race `argmax_v p(v) / E(v)` over its part, with `E = -log u`, u the
   counter-based hash of (seed, counter, v) — the same integer hash as
   `mxrl.engine.sampler.uniform_noise`, in uint32 arithmetic (products wrap mod 2^32 as the
   reference's masked int64 products do); greedy rows race `logp` itself;
3. `sample_pick_kernel`: one program per row takes the best of its parts and the token's logp.
Ties go to the lowest index, as torch.argmax. A row's result depends on that row alone, and its
parts on the vocabulary size alone (batch invariance). One program per row walking all 32k
logits three times took 39 us at any batch size on the H200; the parts run side by side.
"""

from __future__ import annotations

import triton
import triton.language as tl

MIX1 = tl.constexpr(0x7FEB352D)
MIX2 = tl.constexpr(0x2C1B3C6D)
GOLDEN = tl.constexpr(0x1E3779B9)
VOCAB_KEY = tl.constexpr(0x5BD1E995 & 0x7FFFFFFF)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * MIX1
    x = x ^ (x >> 15)
    x = x * MIX2
    return x ^ (x >> 16)


@triton.jit
def _scaled(lg, temp):
    """logit / T, IEEE-rounded (the reference's division)."""
    return tl.div_rn(lg, tl.full(lg.shape, 1.0, tl.float32) * temp)


@triton.jit
def sample_partials_kernel(
    logits_ptr,  # [R, V]
    temp_ptr,  # fp32 [R] (1 for greedy rows)
    max_ptr,  # fp32 [R, S]: per part, max of logit / T
    sum_ptr,  # fp32 [R, S]: per part, sum of exp(logit / T - that max)
    stride_l,
    V,
    S,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_l
    idx = part * BLOCK + tl.arange(0, BLOCK)
    lg = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    x = _scaled(lg, tl.load(temp_ptr + row))
    m = tl.max(x, axis=0)
    shift = tl.where(m == float("-inf"), 0.0, m)  # a part of -inf logits adds 0, not NaN
    tl.store(max_ptr + row * S + part, m)
    tl.store(sum_ptr + row * S + part, tl.sum(tl.exp(x - shift), axis=0))


@triton.jit
def _row_lse(max_ptr, sum_ptr, row, S, S_POW2: tl.constexpr):
    p = tl.arange(0, S_POW2)
    pm = tl.load(max_ptr + row * S + p, mask=p < S, other=float("-inf"))
    ps = tl.load(sum_ptr + row * S + p, mask=p < S, other=0.0)
    m = tl.max(pm, axis=0)
    return m + tl.log(tl.sum(ps * tl.exp(pm - m), axis=0))


@triton.jit
def sample_race_kernel(
    logits_ptr,  # [R, V]
    temp_ptr,  # fp32 [R]
    greedy_ptr,  # int8 [R]
    seeds_ptr,  # int64 [R]
    counters_ptr,  # int64 [R]
    max_ptr,  # fp32 [R, S] (sample_partials_kernel)
    sum_ptr,  # fp32 [R, S]
    lse_ptr,  # fp32 [R]: the row's log-sum-exp (written by part 0)
    score_ptr,  # fp32 [R, S]: per part, the best score
    best_ptr,  # int32 [R, S]: per part, the lowest index with that score
    stride_l,
    V,
    S,
    BLOCK: tl.constexpr,
    S_POW2: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_l
    temp = tl.load(temp_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    lse = _row_lse(max_ptr, sum_ptr, row, S, S_POW2)

    seed = tl.load(seeds_ptr + row)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    ctr = (tl.load(counters_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(lo ^ _mix32(hi ^ _mix32(ctr * GOLDEN + 1)))

    idx = part * BLOCK + tl.arange(0, BLOCK)
    valid = idx < V
    lg = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32)
    logp = _scaled(lg, temp) - lse
    x = _mix32(key ^ (idx.to(tl.uint32) * VOCAB_KEY))
    x = _mix32(x ^ key)
    u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    if greedy:
        score = logp
    else:
        score = tl.div_rn(tl.exp(logp), -tl.log(u))
    score = tl.where(valid, score, float("-inf"))
    top = tl.max(score, axis=0)
    tl.store(score_ptr + row * S + part, top)
    tl.store(best_ptr + row * S + part, tl.min(tl.where(score == top, idx, 2147483647), axis=0))
    if part == 0:
        tl.store(lse_ptr + row, lse)


@triton.jit
def sample_pick_kernel(
    logits_ptr,  # [R, V]
    temp_ptr,  # fp32 [R]
    lse_ptr,  # fp32 [R]
    score_ptr,  # fp32 [R, S]
    best_ptr,  # int32 [R, S]
    token_ptr,  # int64 [R]
    logp_ptr,  # fp32 [R]
    stride_l,
    S,
    S_POW2: tl.constexpr,
):
    row = tl.program_id(0)
    p = tl.arange(0, S_POW2)
    score = tl.load(score_ptr + row * S + p, mask=p < S, other=float("-inf"))
    best = tl.load(best_ptr + row * S + p, mask=p < S, other=2147483647)
    top = tl.max(score, axis=0)
    token = tl.min(tl.where(score == top, best, 2147483647), axis=0)
    lg_t = tl.load(logits_ptr + row.to(tl.int64) * stride_l + token).to(tl.float32)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logp_ptr + row, tl.div_rn(lg_t, tl.load(temp_ptr + row)) - tl.load(lse_ptr + row))
