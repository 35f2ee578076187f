"""SwiGLU's activation silu(gate) * up as one Triton launch forward and one backward (eager:
silu, the product, and in autograd two products and silu's backward, each a kernel reading and
writing the [M, N] activations). Kernels in mxrl/kernels/triton_swiglu.py; the reference,
`silu_mul_reference`, is the eager `F.silu(gate) * up` with torch autograd (the models' op on
CUDA).

The kernels run the eager CUDA ops' arithmetic: silu = x / (1 + e^-x) in fp32 (torch's CUDA
formula, IEEE division) rounded to the dtype, then the product rounded; backward dup =
round(dout * silu), dgate = round(round(dout * up) * s * (1 + x (1 - s))), s = 1 / (1 + e^-x)
(torch's CUDA silu_backward). e^x is libdevice's expf on the GPU, the function CUDA's expf is,
so on CUDA the forward and backward are meant to be the eager ops' bytes. That rests on the same
expf (CUDA and Triton's libdevice versions) and the same FMA contraction of 1 + x (1 - s) by
nvcc and by Triton: tests/kernels/test_swiglu_gpu.py checks it on the GPU, where it passed on
the H200; the models call it on CUDA through `mxrl.nn.invariant.silu_mul`.

Bounds against float64 (silu and its derivative exact, from the same inputs), away from
underflow, for any exp within 3 ulp (CUDA's expf: 2; NumPy's float32 exp, the interpreter's,
measured within 2.4): u = 2^-24, u_D the dtype's unit roundoff (2^-8 bf16, 0 fp32, where the
fp32 product is the one rounding), e = 9u (exp's 6u, 1 + e^-x and the division, and the rest):
  |out^ - silu(x) up| <= |silu(x) up| ((1 + e)(1 + u_D)^2 (1 + u) - 1)
  |dup^ - dout silu(x)| <= the same with dout for up
  |dgate^ - dgate| <= u_D |dgate| + (1 + u_D) 1.01 (u_D + 24u) |dout up| s (1 + |x|)
(the last: round(dout up) u_D + u, s 9u, 1 - s 10u absolute, x (1 - s), the sum with 1 and the
two products one rounding each, all bounded by |dout up| s (1 + |x|) >= |dgate|).

Legend: M rows, N columns (the intermediate size).
"""

from __future__ import annotations

import torch

from mxrl.kernels.backend import triton_interpreter_enabled

_BLOCK = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The eager ops: what the models' `invariant.silu(gate) * up` (mxrl.models.layers.MLP,
    mxrl.nn.experts, mxrl.nn.paths.grouped) runs on CUDA, where invariant.silu is F.silu."""
    return torch.nn.functional.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., N] of one dtype (fp32 / bf16 / fp16), differentiable
    in both: the fused kernels (module docstring), on CUDA or under Triton's interpreter."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in _DTYPES:
        raise ValueError(
            f"silu_mul: gate {tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}: "
            "want one shape and one dtype of float32, bfloat16 or float16"
        )
    return _SiluMul.apply(gate, up)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[M, N] view (a copy only where the leading dims do not flatten), columns contiguous."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g2, u2 = _rows(gate), _rows(up)
        ctx.save_for_backward(g2, u2)
        ctx.shape = gate.shape
        return silu_mul_forward(g2, u2).view(gate.shape)

    @staticmethod
    def backward(ctx, dout):
        g2, u2 = ctx.saved_tensors
        dgate, dup = silu_mul_backward(_rows(dout), g2, u2)
        return dgate.view(ctx.shape), dup.view(ctx.shape)


def _grid(m: int, n: int) -> tuple[tuple[int, int], int]:
    block = min(_BLOCK, max(16, 1 << (n - 1).bit_length()))
    return (m, -(-n // block)), block


def silu_mul_forward(gate_MN: torch.Tensor, up_MN: torch.Tensor) -> torch.Tensor:
    """out [M, N] (contiguous) of [M, N] gate and up with contiguous columns."""
    from mxrl.kernels.triton_swiglu import silu_mul_fwd_kernel

    m, n = gate_MN.shape
    out = torch.empty((m, n), dtype=gate_MN.dtype, device=gate_MN.device)
    if m and n:
        grid, block = _grid(m, n)
        silu_mul_fwd_kernel[grid](
            gate_MN, up_MN, out, n, gate_MN.stride(0), up_MN.stride(0), out.stride(0),
            BLOCK=block, IS_BF16=gate_MN.dtype == torch.bfloat16,
            LIBDEVICE=not triton_interpreter_enabled(), num_warps=4,
        )  # fmt: skip
    return out


def silu_mul_backward(
    dout_MN: torch.Tensor, gate_MN: torch.Tensor, up_MN: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) [M, N] (contiguous) of `silu_mul_forward`."""
    from mxrl.kernels.triton_swiglu import silu_mul_bwd_kernel

    m, n = gate_MN.shape
    dgate = torch.empty((m, n), dtype=gate_MN.dtype, device=gate_MN.device)
    dup = torch.empty_like(dgate)
    if m and n:
        grid, block = _grid(m, n)
        silu_mul_bwd_kernel[grid](
            dout_MN, gate_MN, up_MN, dgate, dup, n, dout_MN.stride(0), gate_MN.stride(0),
            up_MN.stride(0), dgate.stride(0), dup.stride(0),
            BLOCK=block, IS_BF16=gate_MN.dtype == torch.bfloat16,
            LIBDEVICE=not triton_interpreter_enabled(), num_warps=4,
        )  # fmt: skip
    return dgate, dup
