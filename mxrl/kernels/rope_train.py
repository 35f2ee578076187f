"""The trainer's RoPE as one Triton launch forward and one backward, instead of eager PyTorch's five
kernels forward (chunk, neg, cat, two products, a sum) and as many again in its autograd
backward, each reading and writing the whole of q (under fp32 master weights and bf16 autocast,
the normed q and k are fp32: at 16 x 1024 tokens of Qwen3-30B-A3B, 268 MB a layer).
The kernel is the engine's (`rope_kernel` in triton_rowwise.py); the reference,
`rope_reference` in mxrl.kernels.rowwise, is what the model's `ApplyRope` runs otherwise.

Forward: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1) for x = cat(x1, x2):
each product and the sum rounded to the dtype, as the eager ops round them (no FMA: fp32
launches are compiled without contraction). Backward, for the output's gradient g: eager
autograd adds two terms, MulBackward's g * cos and the chunk's SplitBackward of
CatBackward / NegBackward of g * sin, cat((g * sin)[D/2:], -(g * sin)[:D/2]); the kernel adds
the same two rounded terms, once rounded: the same bytes, signed zeros included (a sum of two
-0 is -0 in both). cos and sin take no gradient (the angles are not learned).

Legend: B batch, S tokens, N / Nk query / key heads, D head dim (a power of two).
"""

from __future__ import annotations

import torch

from mxrl.kernels.rowwise import rope_reference

_DTYPES = (torch.float32, torch.bfloat16)


def rope_train_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The kernel takes q [B, N, S, D], k [B, Nk, S, D] and cos / sin [B, S, D] of one dtype
    (float32 or bfloat16), D a power of two, each with its last dim contiguous and its (B, S)
    positions one stride apart (the model's q and k: transposed views of [B, S, heads, D])."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        return False
    b, _, s, d = q.shape
    return (
        q.dtype in _DTYPES
        and k.dtype == cos.dtype == sin.dtype == q.dtype
        and k.shape[0] == b
        and k.shape[2:] == (s, d)
        and cos.shape == sin.shape == (b, s, d)
        and d >= 2
        and d & (d - 1) == 0
        and all(_flat_tokens(t, 2) for t in (q, k))
        and all(_flat_tokens(t, 1) for t in (cos, sin))
    )


def _flat_tokens(t: torch.Tensor, s_dim: int) -> bool:
    """Last dim contiguous, and position (b, s) at b * S + s token strides (or one batch row)."""
    return t.stride(-1) == 1 and (
        t.shape[0] == 1 or t.stride(0) == t.shape[s_dim] * t.stride(s_dim)
    )


def rope_train(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q and k, differentiable in both (module docstring): the kernels where
    `rope_train_fits`, else the reference. Outputs are [B, N, S, D] views of [B, S, N, D]."""
    if not rope_train_fits(q, k, cos, sin):
        return rope_reference(q, k, cos, sin)
    return _FusedRope.apply(q, k, cos, sin)


class _FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        gq, gk = _token_major(gq), _token_major(gk)
        dq, dk = _launch(gq, gk, cos, sin, backward=True)
        return dq, dk, None, None


def _token_major(g: torch.Tensor) -> torch.Tensor:
    """g [B, N, S, D] laid out as the kernel reads it (a [B, S, N, D] buffer), copied if not."""
    if _flat_tokens(g, 2):
        return g
    return g.transpose(1, 2).contiguous().transpose(1, 2)


def _launch(q, k, cos, sin, *, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from mxrl.kernels.triton_rowwise import rope_kernel

    b, n, s, d = q.shape
    nk = k.shape[1]
    q_out = torch.empty((b, s, n, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((b, s, nk, d), dtype=k.dtype, device=k.device)
    if b * s:
        rope_kernel[(b * s, n + nk)](
            q, k, cos, sin, q_out, k_out,
            q.stride(2), q.stride(1), k.stride(2), k.stride(1), cos.stride(1), sin.stride(1),
            n, nk, D=d, IS_BF16=q.dtype == torch.bfloat16, BACKWARD=backward,
            num_warps=1 if d <= 128 else 2, enable_fp_fusion=False,
        )  # fmt: skip
    return q_out.transpose(1, 2), k_out.transpose(1, 2)
