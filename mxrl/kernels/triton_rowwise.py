"""Row-wise Triton kernels of the engine's decode step: RMSNorm, the router's softmax top-k,
the routed experts' grouping and combine, RoPE.
Each program computes one row from that row alone, in an order fixed by the kernel (batch
invariance by construction). References and launchers: mxrl/kernels/rowwise.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxrl.kernels.triton_gemm_decode import bf16_rne


@triton.jit
def round_to(v, dtype: tl.constexpr, IS_BF16: tl.constexpr):
    """fp32 -> dtype, round to nearest even (on the bit pattern for bf16: the interpreter's
    cast truncates, the GPU's rounds; both then give the same bytes)."""
    if IS_BF16:
        return bf16_rne(v)
    return v.to(dtype)


@triton.jit
def rms_rstd(x, H, eps):
    """1 / sqrt(mean(x^2) + eps) of one row x (fp32 [BLOCK], zero past H): the statistics of
    the engine's RMSNorm and of the trainer's (mxrl.kernels.triton_norm), one function so both
    compute the same bytes. IEEE division and square root (plain `/` lowers to the approximate
    div.full.f32)."""
    ss = tl.sum(x * x, axis=0)
    mean = tl.div_rn(ss, tl.full(ss.shape, H, tl.float32))
    root = tl.sqrt_rn(mean + eps)
    return tl.div_rn(tl.full(root.shape, 1.0, tl.float32), root)


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [R, H]
    w_ptr,  # [H]
    out_ptr,  # [R, H]
    stride_x,
    stride_o,
    H,
    eps,
    BLOCK: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = rms_rstd(x, H, eps)
    dtype = out_ptr.dtype.element_ty
    y = round_to(x * r, dtype, IS_BF16)  # the module's cast back to the input dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = round_to(w.to(tl.float32) * y.to(tl.float32), dtype, IS_BF16)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, out, mask=mask)


@triton.jit
def moe_combine_kernel(
    h_ptr,  # [rows, H]: expert outputs, rows sorted by expert
    w_ptr,  # [rows]: the routing weight of each row, in h's dtype
    row_of_ptr,  # int64 [T, k]: the row of token t's j-th expert (ascending expert order)
    out_ptr,  # [T, H]
    stride_h,
    stride_o,
    H,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    """out[t] = sum_j round(h[row_of[t, j]] * w[row]) in h's dtype, j ascending, each product
    and each partial sum rounded to h's dtype — the eager loop's operations, fused."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), tl.float32).to(dtype)
    for j in tl.static_range(K):
        row = tl.load(row_of_ptr + t * K + j)
        h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
        w = tl.load(w_ptr + row)
        p = round_to(h.to(tl.float32) * w.to(tl.float32), dtype, IS_BF16)
        acc = round_to(acc.to(tl.float32) + p.to(tl.float32), dtype, IS_BF16)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, acc, mask=mask)


@triton.jit
def moe_group_kernel(
    ids_ptr,  # int64 [T, K]: each token's experts
    offsets_ptr,  # int32 [E + 1]: the first row of each expert's group
    order_ptr,  # int64 [T * K]: the flat (token, slot) index of each row
    token_of_ptr,  # int64 [T * K]: the token of each row
    rows_ptr,  # int64 [T, K]: each token's rows, ascending (= ascending expert order)
    T,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program e places expert e's entries: rows offset_e + (rank among e's entries in flat
    (token, slot) order), offset_e = number of entries with a smaller expert id — a stable
    counting sort, exact integers (the same as argsort(stable=True) on any device)."""
    e = tl.program_id(0)
    t = tl.arange(0, BLOCK_T)[:, None]
    j = tl.arange(0, BLOCK_K)[None, :]
    valid = (t < T) & (j < K)
    ids = tl.load(ids_ptr + t * K + j, mask=valid, other=-1)
    eq = (ids == e) & valid
    lt = (ids < e) & valid
    offset = tl.sum(tl.sum(lt.to(tl.int32), axis=1), axis=0)
    count = tl.sum(tl.sum(eq.to(tl.int32), axis=1), axis=0)
    flat = tl.reshape(eq.to(tl.int32), [BLOCK_T * BLOCK_K])
    rank = tl.reshape(tl.cumsum(flat, axis=0), [BLOCK_T, BLOCK_K]) - 1
    row = (offset + rank).to(tl.int64)
    tl.store(order_ptr + row, (t * K + j).to(tl.int64), mask=eq)
    tl.store(token_of_ptr + row, (t + j * 0).to(tl.int64), mask=eq)
    # within token t: after its entries with smaller ids, then its earlier entries equal to e
    before = tl.sum(lt.to(tl.int32), axis=1)[:, None] + tl.cumsum(eq.to(tl.int32), axis=1) - 1
    tl.store(rows_ptr + t * K + before, row, mask=eq)
    tl.store(offsets_ptr + e + 1, offset + count)
    if e == 0:
        tl.store(offsets_ptr, offset * 0)


@triton.jit
def rope_kernel(
    q_ptr,  # [T, N, D] (strides given)
    k_ptr,  # [T, Nk, D]
    cos_ptr,  # [T, D]
    sin_ptr,  # [T, D]
    q_out_ptr,  # [T, N, D] contiguous
    k_out_ptr,  # [T, Nk, D] contiguous
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    N,
    NK,
    D: tl.constexpr,
    IS_BF16: tl.constexpr,
    BACKWARD: tl.constexpr = False,
):
    """out = x * cos + rotate_half(x) * sin for one head of one token, each product and the sum
    rounded to the dtype as the eager ops do (rotate_half(x) = cat(-x[D/2:], x[:D/2])).
    BACKWARD: x is the output's gradient g and out the input's, g * cos + rotate_half^T(g * sin)
    (rotate_half^T(y) = cat(y[D/2:], -y[:D/2])), the terms eager autograd adds. fp32 launches
    must not contract a product and the sum into one FMA (`enable_fp_fusion=False`)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    partner = (d + half) % D
    cos = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)
    if BACKWARD:  # the partner's product with its sign flipped (rounding commutes with a sign)
        sign = tl.where(d < half, 1.0, -1.0)
        sin = tl.load(sin_ptr + t * stride_st + partner).to(tl.float32)
    else:
        sign = tl.where(d < half, -1.0, 1.0)
        sin = tl.load(sin_ptr + t * stride_st + d).to(tl.float32)
    dtype = q_out_ptr.dtype.element_ty
    if h < N:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = q_out_ptr + (t * N + h) * D
    else:
        src = k_ptr + t * stride_kt + (h - N) * stride_kh
        dst = k_out_ptr + (t * NK + (h - N)) * D
    x = tl.load(src + d).to(tl.float32)
    rot = tl.load(src + partner).to(tl.float32) * sign
    a = round_to(x * cos, dtype, IS_BF16).to(tl.float32)
    b = round_to(rot * sin, dtype, IS_BF16).to(tl.float32)
    tl.store(dst + d, round_to(a + b, dtype, IS_BF16))


@triton.jit
def moe_route_kernel(
    logits_ptr,  # [T, E]: the router's logits (fp32 / bf16 / fp16)
    ids_ptr,  # int64 [T, K]: the chosen experts, largest logit first
    w_ptr,  # [T, K]: their weights, in the output dtype
    stride_l,
    E,
    K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    """One token: the K largest logits by exact comparisons (ties to the lower expert index,
    NaN above everything as torch.topk ranks it), then the fp32 softmax weights of those
    experts, renormalised over them if NORM (e_j / sum of the chosen e: in exact arithmetic the
    reference's p_j / sum of the chosen p), cast once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < E
    x = tl.load(logits_ptr + t * stride_l + cols, mask=valid, other=float("-inf")).to(tl.float32)
    key = tl.where(x != x, float("inf"), x)
    rank = tl.full((BLOCK,), K, tl.int32)  # each expert's place among the chosen; K: not chosen
    for j in range(K):
        free = valid & (rank == K)
        best = tl.max(tl.where(free, key, float("-inf")), axis=0)
        pick = tl.min(tl.where(free & (key == best), cols, BLOCK), axis=0)
        rank = tl.where(cols == pick, j, rank)
    chosen = rank < K
    # the softmax as the reference computes it: exp(x - max) in fp32 (IEEE division below)
    e = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
    if NORM:
        total = tl.sum(tl.where(chosen, e, 0.0), axis=0)
    else:
        total = tl.sum(e, axis=0)
    w = tl.div_rn(e, tl.full(e.shape, 1.0, tl.float32) * total)
    dtype = w_ptr.dtype.element_ty
    tl.store(ids_ptr + t * K + rank, cols.to(tl.int64), mask=chosen)
    tl.store(w_ptr + t * K + rank, round_to(w, dtype, IS_BF16), mask=chosen)
