"""Fused row-wise ops of the engine's decode step, one launch each instead of the 7–17 small
kernels eager PyTorch launches (a decode step of a small batch is bound by its kernel count:
docs/benchmarks.md, "Rollout"). Kernels in mxrl/kernels/triton_rowwise.py; each function here
has its PyTorch reference beside it, which is also what the CPU runs.

- `rms_norm`: HF Qwen's RMSNorm (fp32 statistics, cast back, times the weight). The kernel sums
  the squares in its own fixed order and takes a correctly rounded 1/sqrt, so its statistics
  differ from the reference's by reordering only: the output is within two roundings of the
  output dtype of the reference (tests/kernels/test_rowwise.py), and a row's bytes depend on
  that row only.
- `moe_combine`: each token's k expert outputs times their routing weights, summed in ascending
  expert order with every product and partial sum rounded to the output dtype — the eager
  loop's exact operations, so the same bytes.

- `moe_group`: the routed experts' grouping (rows sorted by expert, stable in (token, slot)
  order; each group's offset; each token's rows in ascending expert order) as one counting-sort
  launch instead of two sorts, a scatter and a dozen small kernels. Integers, exact: the same
  values as the reference on every device, so any batch may take either.
- `rope`: rotary embeddings of q and k in one launch (bf16), each product and the sum rounded
  to bf16 as the eager ops (`x * cos + rotate_half(x) * sin`) round them: the same bytes.
- `moe_route`: the router's fp32 softmax, top-k, renormalisation and cast (`topk_softmax`,
  which models.layers.TopKSoftmax runs) in one launch for E <= 512. The ids are the k largest logits by exact fp32
  comparisons, ties to the lower expert index: no rounding enters the choice, so they are the
  same on every device, and they are known before any exp. The reference ranks its rounded
  probabilities instead, a non-decreasing function of the logits (its exp is monotone), so
  the ids equal the reference's in every row whose k+1 largest reference probabilities (k if
  k = E) are distinct; where they tie, torch.topk leaves the order (and which tied expert
  takes the last place) unspecified, CPU and CUDA differ, and the kernel's choice is one it
  allows (the reference's probabilities at the kernel's ids are its top-k values, in order).
  Weights: exp and the sums' order differ, so before the cast each is within relative
  (3|y| + E/4 + 64) * 2^-24 of the reference's fp32 weight, y = logit - row max <= 0 (the
  GPU's exp is 2^(y log2 e), within 2 + 1.173|y| ulp: CUDA programming guide, `__expf`;
  E/4 + 64 covers both sums' orders and the other roundings), plus 2^-126 where a
  probability underflows; then each is rounded once to the output dtype.

Legend: R rows, H row length, T tokens, k experts per token, E experts, N / Nk query / key
heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MAX_NORM_ROW = 16384  # one program holds a whole row
_COMBINE_BLOCK = 1024
_MAX_GROUP_ENTRIES = 8192  # one program reads all (token, slot) entries: decode-sized batches
MAX_ROUTE_EXPERTS = 512  # one program holds a token's logits
_ROUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """mxrl.models.layers.RMSNorm.forward, op for op."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] with weight [H] (same dtype as x), one launch."""
    from mxrl.kernels.triton_rowwise import rms_norm_kernel

    h = x.shape[-1]
    if weight.shape != (h,) or weight.dtype != x.dtype or h > _MAX_NORM_ROW:
        raise ValueError(
            f"rms_norm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}: the weight must be [H] in x's dtype, H <= {_MAX_NORM_ROW}"
        )
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], h), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = max(16, 1 << (h - 1).bit_length())
        rms_norm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), out, x2.stride(0), out.stride(0), h, eps,
            BLOCK=block, IS_BF16=x.dtype == torch.bfloat16, num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    return out.view(x.shape)


def moe_combine_reference(
    h_RH: torch.Tensor, w_R: torch.Tensor, row_of_Tk: torch.Tensor
) -> torch.Tensor:
    """out [T, H]: sum over j (ascending) of h[row_of[t, j]] * w[row_of[t, j]], in h's dtype."""
    h = h_RH * w_R[:, None].to(h_RH.dtype)
    out = torch.zeros((row_of_Tk.shape[0], h.shape[1]), dtype=h.dtype, device=h.device)
    for j in range(row_of_Tk.shape[1]):  # fixed order, element-wise: a token sees only its own
        out = out + h[row_of_Tk[:, j]]
    return out


def moe_combine(h_RH: torch.Tensor, w_R: torch.Tensor, row_of_Tk: torch.Tensor) -> torch.Tensor:
    """`moe_combine_reference` in one launch (the same bytes)."""
    from mxrl.kernels.triton_rowwise import moe_combine_kernel

    t, k = row_of_Tk.shape
    rows, hdim = h_RH.shape
    if w_R.shape != (rows,) or row_of_Tk.dtype != torch.int64:
        raise ValueError(
            f"moe_combine: h {tuple(h_RH.shape)}, w {tuple(w_R.shape)} (want [{rows}]), row_of "
            f"{row_of_Tk.dtype} (want int64 [T, k])"
        )
    h = h_RH if h_RH.stride(-1) == 1 else h_RH.contiguous()
    out = torch.empty((t, hdim), dtype=h.dtype, device=h.device)
    if t:
        block = min(_COMBINE_BLOCK, max(16, 1 << (hdim - 1).bit_length()))
        moe_combine_kernel[(t, -(-hdim // block))](
            h, w_R.to(h.dtype).contiguous(), row_of_Tk.contiguous(), out,
            h.stride(0), out.stride(0), hdim, K=k, BLOCK=block,
            IS_BF16=h.dtype == torch.bfloat16, num_warps=4,
        )  # fmt: skip
    return out


def moe_group_reference(
    ids_Tk: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouping of T tokens' k routed experts into rows sorted by expert (stable):

    offsets int32 [E + 1] (expert e's rows are offsets[e]:offsets[e + 1]), order int64 [T k]
    (the flat index t * k + j of each row), token_of int64 [T k] (its token), rows_Tk int64
    [T, k] (each token's rows in ascending expert order, ties in slot order)."""
    t, k = ids_Tk.shape
    flat = ids_Tk.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # counted without bincount, whose CUDA kernel reads the max back to the host (a sync,
    # which a CUDA graph cannot hold)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids_Tk.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids_Tk.device)
    offsets[1:] = torch.cumsum(counts, 0)
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(order.numel(), device=order.device)  # (token, slot) -> row
    rows_Tk = row_of.view(t, k).gather(1, ids_Tk.argsort(dim=1, stable=True))
    return offsets, order, order // k, rows_Tk


def moe_group(
    ids_Tk: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_group_reference` in one launch on CUDA for up to 8192 entries (the same integers;
    larger batches, the CPU and other dtypes take the reference). ids must lie in [0, E)."""
    t, k = ids_Tk.shape
    if ids_Tk.device.type != "cuda" or ids_Tk.dtype != torch.int64 or t * k > _MAX_GROUP_ENTRIES:
        return moe_group_reference(ids_Tk, num_experts)
    return _moe_group_launch(ids_Tk, num_experts)


def _moe_group_launch(ids_Tk: torch.Tensor, num_experts: int):
    from mxrl.kernels.triton_rowwise import moe_group_kernel

    t, k = ids_Tk.shape
    dev = ids_Tk.device
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    order = torch.empty(t * k, dtype=torch.int64, device=dev)
    token_of = torch.empty(t * k, dtype=torch.int64, device=dev)
    rows = torch.empty((t, k), dtype=torch.int64, device=dev)
    if t == 0:
        offsets.zero_()
        return offsets, order, token_of, rows
    block_t = max(2, 1 << (t - 1).bit_length())
    block_k = max(2, 1 << (k - 1).bit_length())
    moe_group_kernel[(num_experts,)](
        ids_Tk.contiguous(), offsets, order, token_of, rows, t,
        K=k, BLOCK_T=block_t, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return offsets, order, token_of, rows


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BNSD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding of one tensor [B, N, S, D]: x * cos + rotate_half(x) * sin."""
    cos, sin = cos_BSD[:, None], sin_BSD[:, None]
    return x_BNSD * cos + _rotate_half(x_BNSD) * sin


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` of q [B, N, S, D] and k [B, Nk, S, D], cos / sin [B, S, D]: the model's RoPE
    (mxrl.models.layers.ApplyRope runs this function)."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_reference` in one launch for B = 1 (the engine's ragged row), bf16, D a power of
    two; otherwise the reference (fp32 too: the compiler may contract its product and sum into
    one FMA, which the eager ops do not). Outputs are [1, N, S, D] views of [1, S, N, D]."""
    b, n, s, d = q.shape
    ok = (
        b == 1
        and q.dtype == torch.bfloat16
        and k.dtype == cos.dtype == sin.dtype == q.dtype
        and d >= 2
        and d & (d - 1) == 0
        and q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
    )
    if not ok:
        return rope_reference(q, k, cos, sin)
    from mxrl.kernels.triton_rowwise import rope_kernel

    nk = k.shape[1]
    q_out = torch.empty((1, s, n, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((1, s, nk, d), dtype=k.dtype, device=k.device)
    if s:
        rope_kernel[(s, n + nk)](
            q, k, cos, sin, q_out, k_out,
            q.stride(2), q.stride(1), k.stride(2), k.stride(1), cos.stride(1), sin.stride(1),
            n, nk, D=d, IS_BF16=True, num_warps=1 if d <= 128 else 2,
        )  # fmt: skip
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def topk_softmax(
    logits_TE: torch.Tensor, top_k: int, norm: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's selection (mxrl.models.layers.TopKSoftmax runs this function): fp32 softmax
    over the E experts, the k largest probabilities (renormalised to sum to 1 if `norm`), cast to
    `out_dtype`. (ids [T, k] int64, weights [T, k]), in descending probability."""
    probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float32)
    weights_Tk, ids_Tk = torch.topk(probs_TE, top_k, dim=-1)
    if norm:
        weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
    return ids_Tk, weights_Tk.to(out_dtype)


def moe_route_reference(
    logits_TE: torch.Tensor, top_k: int, norm: bool, out_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_softmax`: (ids int64 [T, k], weights [T, k] out_dtype)."""
    return topk_softmax(logits_TE, top_k, norm, out_dtype)


def moe_route(
    logits_TE: torch.Tensor, top_k: int, norm: bool, out_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route_reference` in one launch (module docstring: the same ids, weights within a
    bound) for logits [T, E] in fp32 / bf16 / fp16, E <= MAX_ROUTE_EXPERTS, 1 <= top_k <= E."""
    if logits_TE.dim() != 2 or logits_TE.dtype not in _ROUTE_DTYPES:
        raise ValueError(
            f"moe_route: logits {tuple(logits_TE.shape)} {logits_TE.dtype}: want [T, E] in "
            "float32, bfloat16 or float16 (flatten the batch dims first)"
        )
    t, e = logits_TE.shape
    if e > MAX_ROUTE_EXPERTS:
        raise ValueError(
            f"moe_route: {e} experts; one program holds a row of at most {MAX_ROUTE_EXPERTS}: "
            "use moe_route_reference"
        )
    if not 1 <= top_k <= e:
        raise ValueError(f"moe_route: top_k must be in [1, {e}] (the experts), got {top_k}")
    if out_dtype not in _ROUTE_DTYPES:
        raise ValueError(
            f"moe_route: out_dtype must be float32, bfloat16 or float16, got {out_dtype}"
        )
    from mxrl.kernels.triton_rowwise import moe_route_kernel

    logits = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, top_k), dtype=out_dtype, device=logits.device)
    if t:
        block = max(16, 1 << (e - 1).bit_length())
        moe_route_kernel[(t,)](
            logits, ids, weights, logits.stride(0), e, K=top_k, NORM=bool(norm), BLOCK=block,
            IS_BF16=out_dtype == torch.bfloat16, num_warps=1 if block <= 256 else 2,
        )  # fmt: skip
    return ids, weights
