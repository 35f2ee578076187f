"""Sampling one token per row in one launch: the Triton kernel behind
`mxrl.kernels.sampling.sample_rows` (temperature only: no top-k / top-p filter).

One program per row walks the row's logits three times in fixed-size blocks: the max, then the
sum of exp (the log-sum-exp), then the exponential race `argmax_v p(v) / E(v)` with
`E = -log u`, u the counter-based hash of (seed, counter, v) — the same integer hash as
`mxrl.engine.sampler.uniform_noise`, in uint32 arithmetic (products wrap mod 2^32 as the
reference's masked int64 products do). Greedy rows take `argmax logp`. Ties go to the lowest
index, as torch.argmax. A row's result depends on that row alone (batch invariance).
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
def sample_rows_kernel(
    logits_ptr,  # [R, V]
    temp_ptr,  # fp32 [R] (1 for greedy rows)
    greedy_ptr,  # int8 [R]
    seeds_ptr,  # int64 [R]
    counters_ptr,  # int64 [R]
    token_ptr,  # int64 [R]
    logp_ptr,  # fp32 [R]
    stride_l,
    V,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_l
    temp = tl.load(temp_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    offs = tl.arange(0, BLOCK)

    m_vec = tl.full((BLOCK,), float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + offs
        lg = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        m_vec = tl.maximum(m_vec, tl.div_rn(lg, tl.full(lg.shape, 1.0, tl.float32) * temp))
    m = tl.max(m_vec, axis=0)
    s_vec = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + offs
        lg = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        s_vec += tl.exp(tl.div_rn(lg, tl.full(lg.shape, 1.0, tl.float32) * temp) - m)
    lse = m + tl.log(tl.sum(s_vec, axis=0))

    seed = tl.load(seeds_ptr + row)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    ctr = (tl.load(counters_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(lo ^ _mix32(hi ^ _mix32(ctr * GOLDEN + 1)))

    best_score = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.full((BLOCK,), 2147483647, tl.int32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + offs
        valid = idx < V
        lg = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32)
        logp = tl.div_rn(lg, tl.full(lg.shape, 1.0, tl.float32) * temp) - lse
        x = _mix32(key ^ (idx.to(tl.uint32) * VOCAB_KEY))
        x = _mix32(x ^ key)
        u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        if greedy:
            score = logp
        else:
            score = tl.div_rn(tl.exp(logp), -tl.log(u))
        score = tl.where(valid, score, float("-inf"))
        better = score > best_score  # strict: an earlier block keeps its tie
        best_idx = tl.where(better, idx, best_idx)
        best_score = tl.where(better, score, best_score)
    top = tl.max(best_score, axis=0)
    token = tl.min(tl.where(best_score == top, best_idx, 2147483647), axis=0)
    lg_t = tl.load(base + token).to(tl.float32)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logp_ptr + row, tl.div_rn(lg_t, temp) - lse)
