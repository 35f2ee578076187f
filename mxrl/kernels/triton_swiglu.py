"""Triton kernels of the fused SwiGLU activation silu(gate) * up: the forward and the backward,
each one launch over [M, N] rows (gate and up may be the two halves of one gate_up tensor: any
row strides, contiguous columns). Launchers, reference and bounds: mxrl/kernels/swiglu.py.

Element-wise: an element's bytes depend on that element alone.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from mxrl.kernels.triton_rowwise import round_to


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """e^x: CUDA's expf (libdevice's __nv_expf, what torch's CUDA silu calls) on the GPU;
    the interpreter has no libdevice and takes NumPy's exp."""
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _sigmoid(x, LIBDEVICE: tl.constexpr):
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + _exp(-x, LIBDEVICE))


@triton.jit
def _silu(x, dtype: tl.constexpr, IS_BF16: tl.constexpr, LIBDEVICE: tl.constexpr):
    """torch's silu of x (fp32): x / (1 + e^-x), its CUDA formula, rounded to the dtype; back
    in fp32."""
    return round_to(tl.div_rn(x, 1.0 + _exp(-x, LIBDEVICE)), dtype, IS_BF16).to(tl.float32)


@triton.jit
def silu_mul_fwd_kernel(
    gate_ptr,  # [M, N]
    up_ptr,  # [M, N]
    out_ptr,  # [M, N]
    N,
    stride_gate,
    stride_up,
    stride_out,
    BLOCK: tl.constexpr,
    IS_BF16: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """out = round(round(x / (1 + e^-x)) * up), x = gate in fp32: torch's silu (its CUDA
    formula, rounded to the dtype) then the product rounded, the eager ops' roundings."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    s = _silu(x, dtype, IS_BF16, LIBDEVICE)
    tl.store(out_ptr + row * stride_out + cols, round_to(s * u, dtype, IS_BF16), mask=mask)


@triton.jit
def silu_mul_bwd_kernel(
    dout_ptr,  # [M, N]
    gate_ptr,  # [M, N]
    up_ptr,  # [M, N]
    dgate_ptr,  # [M, N]
    dup_ptr,  # [M, N]
    N,
    stride_dout,
    stride_gate,
    stride_up,
    stride_dgate,
    stride_dup,
    BLOCK: tl.constexpr,
    IS_BF16: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """The eager autograd's operations: dup = round(dout * silu(x) rounded); the product's
    gradient to silu, round(dout * up), times torch's silu derivative s (1 + x (1 - s)),
    s = 1 / (1 + e^-x), rounded."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dy = tl.load(dout_ptr + row * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = dgate_ptr.dtype.element_ty
    silu = _silu(x, dtype, IS_BF16, LIBDEVICE)
    dup = round_to(dy * silu, dtype, IS_BF16)
    tl.store(dup_ptr + row * stride_dup + cols, dup, mask=mask)
    ds = round_to(dy * u, dtype, IS_BF16).to(tl.float32)
    s = _sigmoid(x, LIBDEVICE)
    dgate = round_to(ds * s * (1.0 + x * (1.0 - s)), dtype, IS_BF16)
    tl.store(dgate_ptr + row * stride_dgate + cols, dgate, mask=mask)
