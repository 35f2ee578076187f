"""The trainer's RMSNorm as fused Triton kernels: one launch forward, two backward (instead of
the ~7 kernels of eager PyTorch's forward and more of its autograd backward). Kernels in
mxrl/kernels/triton_norm.py; the reference, `rms_norm_train_reference`, is the model's eager
RMSNorm (mxrl.models.layers.RMSNorm) with torch autograd, which the CPU runs.

Forward: y = (x * r) cast to x's dtype, r = 1 / sqrt(mean(x^2) + eps); out = w * y in the
promoted dtype of x and w (fp32 master weights under bf16 autocast give fp32 outputs, as the
eager module's type promotion does). The statistics are the engine's (`rms_rstd` in
triton_rowwise.py, the same launch shape): where x and w share a dtype, the output is the bytes
mxrl.kernels.rowwise.rms_norm gives the rollout engine, within two roundings of the output dtype
of the reference (rowwise.py states why). r is saved (fp32, one per row) with x and w.

Backward, with a = g * w (g the output's gradient), xhat = x * r, c = mean(a * xhat):
  dx = r * (a - xhat * c), cast to x's dtype; a row's dx depends on that row only (its bytes
  too: each row is reduced in a layout fixed by H).
  dw = sum over rows of g * y, y the forward's bytes: each program sums its rows into an fp32
  partial, then the partials are summed in ascending order (deterministic; the split depends
  on R and H only), rounded once to w's dtype.

Bounds against the exact gradient (the reference's math in float64 from the same x, w, g and
eps, rounded to fp32 as the kernels receive it), away from underflow. u = 2^-24; u_D, u_W the
unit roundoffs of x's and w's dtypes (2^-8 bf16, 2^-11 fp16, 0 fp32: no rounding there);
gamma_k = k u / (1 - k u); exact r, a_i, and per row C = (r / H) sum_j |a_j x_j|.
- r: sum of squares in some order (gamma_H over nonnegative terms), the mean, + eps, sqrt and
  1/root each correctly rounded: |r^ / r - 1| <= rho = (1 + u) / ((1 - u) sqrt(1 - gamma_{H+2}))
  - 1, about (H/2 + 3) u.
- dx: the products a_j xhat_j carry rho and three roundings, their sum gamma_{H-1} more:
  |S^ - S| <= (rho + gamma_{H+2}) H C; then c, xhat c, the difference and the product by r^
  one rounding each. To first order, with a factor 1 + 2 (rho + gamma_{H+2}) for the rest:
    |dx^_i - dx_i| <= u_D |dx_i| + (1 + u_D) (1 + 2 (rho + gamma_{H+2}))
                      * (r |a_i| (rho + 3u) + r^2 |x_i| C (3 rho + gamma_{H+2} + 5u)).
- dw: each term g y carries rho, two roundings and y's u_D; R terms summed in any split and
  order (gamma_{R-1}; added zeros are exact), then the cast to w's dtype:
    |dw^_j - dw_j| <= u_W |dw_j| + (1 + u_W) (e + gamma_{R-1} (1 + e)) sum_i |g_ij x_ij r_i|,
    e = (1 + rho)(1 + u)^2 (1 + u_D) - 1.
These are worst cases over every summation order; a Triton reduction's error grows like the
log of its length, far below them (tests/kernels/test_norm_train.py checks the bounds).

Legend: R rows, H row length, P backward programs.
"""

from __future__ import annotations

import torch

from mxrl.kernels.rowwise import rms_norm_reference

_MAX_NORM_ROW = 16384  # one program holds a whole row (as the engine's kernel)
_TILE = 2048  # the backward's rows x columns per step: BLOCK_R = max(1, _TILE // BLOCK)
_MAX_BWD_PROGRAMS = 1024  # the dw partials: at most this many rows of fp32 [H]
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_train_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's eager RMSNorm (its backward is torch autograd's)."""
    return rms_norm_reference(x, weight, eps)


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] with weight [H], differentiable in x and weight:
    the fused kernels (module docstring), on CUDA or under Triton's interpreter."""
    _check(x, weight)
    return _FusedRMSNorm.apply(x, weight, eps)


def fused_norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernels take x [..., H] and weight [H] in float32 / bfloat16 / float16, H <= 16384
    (float64 and wider rows: the reference)."""
    h = x.shape[-1] if x.dim() else -1
    return (
        weight.shape == (h,)
        and x.dtype in _DTYPES
        and weight.dtype in _DTYPES
        and h <= _MAX_NORM_ROW
    )


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not fused_norm_fits(x, weight):
        raise ValueError(
            f"rms_norm_train: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}: the weight must be [H], H <= {_MAX_NORM_ROW}, both float32, "
            "bfloat16 or float16; use rms_norm_train_reference otherwise"
        )


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        h = x.shape[-1]
        x_RH = x.reshape(-1, h)
        if x_RH.stride(-1) != 1:
            x_RH = x_RH.contiguous()
        out_RH, rstd_R = rms_norm_forward(x_RH, weight, eps)
        ctx.save_for_backward(x_RH, weight, rstd_R)
        ctx.x_shape = x.shape
        return out_RH.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x_RH, weight, rstd_R = ctx.saved_tensors
        g_RH = grad_out.reshape(-1, x_RH.shape[1])
        if g_RH.stride(-1) != 1:
            g_RH = g_RH.contiguous()
        dx_RH, dw = rms_norm_backward(g_RH, x_RH, weight, rstd_R)
        return dx_RH.view(ctx.x_shape), dw, None


def _is_bf16(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16


def _block(h: int) -> int:
    return max(16, 1 << (h - 1).bit_length())


def rms_norm_forward(
    x_RH: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [R, H] in the promoted dtype of x and weight, fp32 1/rms [R]); x's last dim
    contiguous. The launch shape of mxrl.kernels.rowwise.rms_norm (its reduction order)."""
    from mxrl.kernels.triton_norm import rms_norm_fwd_kernel

    rows, h = x_RH.shape
    out_dtype = torch.promote_types(x_RH.dtype, weight.dtype)
    out = torch.empty((rows, h), dtype=out_dtype, device=x_RH.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x_RH.device)
    if rows:
        block = _block(h)
        rms_norm_fwd_kernel[(rows,)](
            x_RH, weight.contiguous(), out, rstd, x_RH.stride(0), out.stride(0), h, eps,
            BLOCK=block, X_BF16=_is_bf16(x_RH), OUT_BF16=_is_bf16(out),
            num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    return out, rstd


def backward_split(rows: int, h: int) -> tuple[int, int, int]:
    """(BLOCK_R rows a step, rows per program, programs P) of the backward: a function of R
    and H only, so the dw partials and their order are too."""
    block_r = max(1, _TILE // _block(h))
    steps = -(-rows // block_r)
    programs = max(1, min(steps, _MAX_BWD_PROGRAMS))
    per_program = -(-steps // programs) * block_r
    return block_r, per_program, max(1, -(-rows // per_program))


def rms_norm_backward(
    g_RH: torch.Tensor, x_RH: torch.Tensor, weight: torch.Tensor, rstd_R: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [R, H] in x's dtype, dweight [H] in weight's dtype) of `rms_norm_forward`."""
    from mxrl.kernels.triton_norm import rms_norm_bwd_kernel, sum_partials_kernel

    rows, h = x_RH.shape
    dev = x_RH.device
    dx = torch.empty((rows, h), dtype=x_RH.dtype, device=dev)
    dw = torch.empty(h, dtype=weight.dtype, device=dev)
    if rows == 0:
        return dx, dw.zero_()
    block = _block(h)
    block_r, per_program, programs = backward_split(rows, h)
    part = torch.empty((programs, h), dtype=torch.float32, device=dev)
    rms_norm_bwd_kernel[(programs,)](
        x_RH, weight.contiguous(), g_RH, rstd_R, dx, part, rows, h, per_program,
        x_RH.stride(0), g_RH.stride(0), dx.stride(0),
        BLOCK_R=block_r, BLOCK=block, X_BF16=_is_bf16(x_RH),
        num_warps=4 if block_r * block <= 2048 else 8,
    )  # fmt: skip
    sum_block = min(block, 1024)
    sum_partials_kernel[(-(-h // sum_block),)](
        part, dw, programs, h, BLOCK=sum_block, OUT_BF16=_is_bf16(dw), num_warps=4
    )
    return dx, dw
