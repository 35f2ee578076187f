"""The fused SwiGLU activation (mxrl.kernels.swiglu) compiled on a GPU: the forward and the
backward the bytes of the eager `F.silu(gate) * up` and its autograd on CUDA (what would allow
the models to call it: until this passes on the H200 they do not), and within the docstring's
bounds of float64. Interpreter tier: tests/kernels/test_swiglu.py."""

from __future__ import annotations

import pytest
import torch

from mxrl.kernels.swiglu import silu_mul, silu_mul_reference
from tests.kernels.test_swiglu import (
    SPECIAL,
    UNIT,
    E,
    U,
    check_within,
    exact,
    operands,
    without_nans,
)
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def grads(fn, gate, up, dout):
    g, u = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    out = fn(g, u)
    out.backward(dout)
    return out, g.grad, u.grad


def check_eager_bytes(gate, up, dout, what):
    """Every byte, except a NaN's sign and payload (NaN where the eager op gives NaN)."""
    want = grads(silu_mul_reference, gate, up, dout)
    got = grads(silu_mul, gate, up, dout)
    for name, a, b in zip(("out", "dgate", "dup"), got, want, strict=True):
        assert_bytes_equal(*without_nans(a, b), f"{what} {name}")


@pytest.mark.parametrize("n", [768, 1536, 96])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_eager_ops_bytes(dtype, n):
    gate, up, dout = (t.to(CUDA) for t in operands(16384, n, dtype, seed=n))
    check_eager_bytes(gate, up, dout, f"{dtype} {n}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_eager_ops_bytes_at_special_values(dtype):
    x = torch.tensor(SPECIAL, dtype=dtype)
    gate = x[:, None].expand(-1, len(SPECIAL)).contiguous().to(CUDA)
    up = x[None, :].expand(len(SPECIAL), -1).contiguous().to(CUDA)
    dout = torch.ones_like(gate) * 3
    check_eager_bytes(gate, up, dout, "special")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_within_the_stated_bounds_of_float64(dtype):
    gate, up, dout = (t.to(CUDA) for t in operands(8192, 768, dtype, seed=1))
    out, dgate, dup = grads(silu_mul, gate, up, dout)
    out64, dgate64, dup64, s = exact(gate, up, dout)
    ud = UNIT[dtype]
    rel = (1 + E) * (1 + ud) ** 2 * (1 + U) - 1
    check_within(out, out64, rel * out64.abs(), "out")
    check_within(dup, dup64, rel * dup64.abs(), "dup")
    mag = (dout.double() * up.double()).abs() * s * (1 + gate.double().abs())
    bound = ud * dgate64.abs() + (1 + ud) * 1.01 * (ud + 24 * U) * mag
    check_within(dgate, dgate64, bound, "dgate")


def test_the_models_call_the_fused_op_on_cuda(monkeypatch):
    """invariant.silu_mul (the models' SwiGLU: MLP, the experts' loop and grouped paths) runs the
    fused kernels on CUDA, and a grouped MoE step gives the eager path's bytes."""
    import mxrl.kernels.swiglu as swiglu
    from mxrl.nn import invariant

    calls = []
    fused = swiglu.silu_mul
    monkeypatch.setattr(swiglu, "silu_mul", lambda g, u: calls.append(g.shape) or fused(g, u))
    gate, up, dout = (t.to(CUDA) for t in operands(4096, 768, torch.bfloat16, seed=5))
    got = grads(invariant.silu_mul, gate, up, dout)
    assert calls, "invariant.silu_mul did not call the fused op on CUDA"
    want = grads(silu_mul_reference, gate, up, dout)
    for name, a, b in zip(("out", "dgate", "dup"), got, want, strict=True):
        assert_bytes_equal(*without_nans(a, b), f"invariant.silu_mul {name}")
