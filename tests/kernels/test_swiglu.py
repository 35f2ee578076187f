"""The fused SwiGLU activation (mxrl.kernels.swiglu) under Triton's interpreter: the bytes of a
transcription of the eager CUDA ops' arithmetic (with the interpreter's exp, NumPy's), within
the docstring's bounds of float64, an element's bytes independent of the batch. The GPU tier
(the eager ops' bytes on CUDA): tests/kernels/test_swiglu_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxrl.kernels.swiglu import silu_mul, silu_mul_backward, silu_mul_forward
from tests.kernels.test_decode_gemm import interpreter
from tests.numerics import assert_bytes_equal

U = 2.0**-24
UNIT = {torch.float32: 0.0, torch.bfloat16: 2.0**-8}
E = 9 * U
# every region of silu and its derivative: its zero (-1.2785), underflowing and saturating
# exp, signed zeros, the largest finite values, inf and NaN
SPECIAL = [0.0, -0.0, 1.0, -1.0, -1.2785, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 89.0,
           -104.0, -110.0, 3e38, -3e38, float("inf"), float("-inf"), float("nan")]  # fmt: skip


def operands(m, n, dtype, seed=0):
    """gate and up as the two halves of one gate_up [m, 2n] (the models' chunk), dout."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(m, 2 * n, generator=gen) * 4).to(dtype)
    dout = torch.randn(m, n, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return gate, up, dout


def np_exp(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.exp(x.numpy()))


def eager_ops(gate, up, dout):
    """torch's CUDA silu, the product and their autograd backward, op by op in fp32 with each
    rounding to the dtype where the eager ops round, exp NumPy's (the interpreter's)."""
    dtype = gate.dtype
    x, u, dy = gate.float(), up.float(), dout.float()
    silu = (x / (1.0 + np_exp(-x))).to(dtype).float()
    out = (silu * u).to(dtype)
    dup = (dy * silu).to(dtype)
    ds = (dy * u).to(dtype).float()
    s = 1.0 / (1.0 + np_exp(-x))
    dgate = (ds * s * (1.0 + x * (1.0 - s))).to(dtype)
    return out, dgate, dup


def exact(gate, up, dout):
    x, u, dy = gate.double(), up.double(), dout.double()
    s = torch.sigmoid(x)
    return x * s * u, dy * u * s * (1 + x * (1 - s)), dy * x * s, s


def without_nans(a, b):
    """a and b with their NaNs zeroed, after checking they lie in the same places (a NaN's sign
    and payload are the hardware's, not the op's)."""
    assert torch.equal(a.isnan(), b.isnan()), "NaNs in other places"
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    return a.where(~a.isnan(), zero), b.where(~b.isnan(), zero)


def check_within(got, want, bound, what):
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"{what}: {(err / bound).max().item():.3g} of the bound"


@interpreter
@pytest.mark.parametrize("n", [768, 96])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_eager_ops_bytes_with_the_interpreters_exp(dtype, n):
    gate, up, dout = operands(9, n, dtype, seed=n)
    want_out, want_dgate, want_dup = eager_ops(gate, up, dout)
    assert_bytes_equal(silu_mul_forward(gate, up), want_out, "out")
    dgate, dup = silu_mul_backward(dout, gate, up)
    assert_bytes_equal(dgate, want_dgate, "dgate")
    assert_bytes_equal(dup, want_dup, "dup")


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_within_the_stated_bounds_of_float64(dtype):
    gate, up, dout = operands(11, 768, dtype, seed=1)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = silu_mul(g, u)
    out.backward(dout)
    out64, dgate64, dup64, s = exact(gate, up, dout)
    ud = UNIT[dtype]
    rel = (1 + E) * (1 + ud) ** 2 * (1 + U) - 1
    check_within(out, out64, rel * out64.abs(), "out")
    check_within(u.grad, dup64, rel * dup64.abs(), "dup")
    mag = (dout.double() * up.double()).abs() * s * (1 + gate.double().abs())
    bound = ud * dgate64.abs() + (1 + ud) * 1.01 * (ud + 24 * U) * mag
    check_within(g.grad, dgate64, bound, "dgate")


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's exp overflowing to inf
def test_the_eager_ops_bytes_at_special_values(dtype):
    x = torch.tensor(SPECIAL, dtype=dtype)
    gate = x[:, None].expand(-1, len(SPECIAL)).contiguous()
    up = x[None, :].expand(len(SPECIAL), -1).contiguous()
    dout = torch.full_like(gate, 3)
    want = eager_ops(gate, up, dout)
    got = (silu_mul_forward(gate, up), *silu_mul_backward(dout, gate, up))
    for name, a, b in zip(("out", "dgate", "dup"), got, want, strict=True):
        assert_bytes_equal(*without_nans(a, b), name)


@interpreter
def test_an_elements_bytes_do_not_depend_on_the_batch():
    gate, up, dout = operands(17, 96, torch.bfloat16, seed=2)
    out = silu_mul_forward(gate, up)
    dgate, dup = silu_mul_backward(dout, gate, up)
    for r in (0, 9, 16):
        row = slice(r, r + 1)
        assert_bytes_equal(silu_mul_forward(gate[row], up[row]), out[row], f"out {r}")
        alone = silu_mul_backward(dout[row], gate[row], up[row])
        assert_bytes_equal(alone[0], dgate[row], f"dgate {r}")
        assert_bytes_equal(alone[1], dup[row], f"dup {r}")


@interpreter
def test_leading_dims_and_no_rows():
    gate, up, dout = operands(6, 40, torch.bfloat16, seed=3)
    g3 = gate.reshape(2, 3, 40).clone().requires_grad_()
    u3 = up.reshape(2, 3, 40).clone().requires_grad_()
    silu_mul(g3, u3).backward(dout.view(2, 3, 40))
    dgate, dup = silu_mul_backward(dout, gate, up)
    assert_bytes_equal(g3.grad, dgate.view(2, 3, 40), "dgate")
    assert_bytes_equal(u3.grad, dup.view(2, 3, 40), "dup")
    empty = torch.empty(0, 40, dtype=torch.bfloat16, requires_grad=True)
    out = silu_mul(empty, empty)
    out.sum().backward()
    assert out.shape == (0, 40) and empty.grad.shape == (0, 40)


def test_refuses_operands_of_two_dtypes():
    with pytest.raises(ValueError, match="one dtype"):
        silu_mul(torch.ones(2, 8), torch.ones(2, 8, dtype=torch.bfloat16))
