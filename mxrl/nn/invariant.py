"""Element-wise functions whose value for an element depends on that element alone, on every CPU
capability (default, AVX2, AVX-512) and on CUDA: a token's activations cannot depend on where it
sits in a batch (docs/engine.md, "Batch invariance").

Why not `torch.sigmoid` / `F.silu` on the CPU: ATen's element-wise CPU kernels run a vectorized
body (SLEEF) over whole vectors and a scalar loop (libm) over the remainder, and the two round
some results differently (one ulp of sigmoid or silu, measured). Which elements fall into the
remainder depends on the tensor's size, on the slice each thread gets and on the processor's
vector width, so one token's bytes depended on how many other tokens were in its batch, and
differently on an AVX2 and an AVX-512 machine. Here `exp` is built from IEEE basic operations
(+, -, *, /, floor, min/max, bit casts), each one torch op (no fused multiply-add), each
correctly rounded in the vector body, in the scalar loop and on every capability: every element
takes the same arithmetic wherever it lies, and the result is the same on every x86-64 CPU.

On CUDA every element-wise kernel applies one per-element function to every element (vectorized
loads change the memory access, not the math), so the torch functions are kept there.
float64 inputs also keep the torch functions (nothing on the model's path is float64).

The approximation is Cephes' `expf` (Cody-Waite reduction by ln 2, degree-5 polynomial): at most
about one ulp from the exact value over the whole fp32 range (tests/nn/test_invariant.py).
"""

from __future__ import annotations

import torch

__all__ = ["exp", "sigmoid", "silu", "silu_mul"]

_LOG2E = 1.44269504088896341
_LN2_HI = 0.693359375  # 9 significant bits: n * _LN2_HI is exact for |n| < 2^15
_LN2_LO = -2.12194440e-4
_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1)
_POLY_LAST = 5.0000001201e-1
# below -104 exp underflows to 0 in fp32, above 89 it overflows: clamping keeps 2^n in range
_X_MIN, _X_MAX = -104.0, 89.0


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2^n as fp32 for integer-valued fp32 n in [-126, 127], exactly (built from its bits)."""
    return n.to(torch.int32).add_(127).bitwise_left_shift_(23).view(torch.float32)


def _exp_ieee(x: torch.Tensor) -> torch.Tensor:
    """exp of fp32 x from correctly rounded basic operations only (module docstring)."""
    xc = x.clamp(_X_MIN, _X_MAX)
    n = xc.mul(_LOG2E).add_(0.5).floor_()  # nearest integer to x / ln 2
    r = n.mul(_LN2_HI).neg_().add_(xc)
    r.sub_(n.mul(_LN2_LO))  # |r| <= ln2 / 2
    p = r.mul(_POLY[0]).add_(_POLY[1])
    for c in (*_POLY[2:], _POLY_LAST):
        p.mul_(r).add_(c)
    p.mul_(r.square()).add_(r).add_(1.0)
    # 2^n as two exact factors, so n down to -150 (subnormal results) and up to 128 (overflow
    # to inf) need no special case
    half = n.mul(0.5).floor_()
    p.mul_(_pow2(half)).mul_(_pow2(n.sub_(half)))
    return p.where(~x.isnan(), x)


def _on_cpu_fp(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x; on the CPU from basic operations (fp32 arithmetic, result in x's dtype)."""
    if not _on_cpu_fp(x):
        return torch.exp(x)
    return _exp_ieee(x.float()).to(x.dtype)


def _sigmoid_fp32(x: torch.Tensor) -> torch.Tensor:
    return torch.div(torch.ones_like(x), 1.0 + _exp_ieee(-x))


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        s = _sigmoid_fp32(x.float())
        ctx.save_for_backward(s)
        ctx.dtype = x.dtype
        return s.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (s,) = ctx.saved_tensors
        return (dy.float() * (s * (1.0 - s))).to(ctx.dtype)


class _SiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        ctx.save_for_backward(x)
        # torch's formula, x / (1 + e^-x): one rounding fewer than x * sigmoid(x)
        return torch.div(x32, 1.0 + _exp_ieee(-x32)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        x32 = x.float()
        s = _sigmoid_fp32(x32)
        return (dy.float() * (s * (1.0 + x32 * (1.0 - s)))).to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x), differentiable; on the CPU from basic operations."""
    if not _on_cpu_fp(x):
        return torch.sigmoid(x)
    return _Sigmoid.apply(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + e^-x) (SwiGLU's activation), differentiable; on the CPU from basic operations."""
    if not _on_cpu_fp(x):
        return torch.nn.functional.silu(x)
    return _SiLU.apply(x)


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up, differentiable. On CUDA with Triton: the fused kernels of
    mxrl.kernels.swiglu, one launch forward and one backward instead of silu, the product and
    their autograd — the eager ops' bytes, forward and backward (tests/kernels/test_swiglu_gpu.py,
    special values included); elsewhere `silu(gate) * up`."""
    if (
        gate.is_cuda
        and gate.numel()
        and gate.shape == up.shape
        and gate.dtype == up.dtype
        and gate.dtype in _FUSED_DTYPES
    ):
        from mxrl.kernels.backend import tracing, triton_available

        if triton_available() and not tracing():
            from mxrl.kernels.swiglu import silu_mul as fused

            return fused(gate, up)
    return silu(gate) * up
