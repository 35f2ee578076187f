"""The fused SwiGLU activation (mxrl.kernels.swiglu) under Triton's interpreter: the bytes of a
transcription of the eager CUDA ops' arithmetic (with the interpreter's exp, NumPy's), within
the docstring's bounds of float64, an element's bytes independent of the batch. The GPU tier
(the eager ops' bytes on CUDA): tests/kernels/test_swiglu_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxrl.kernels.swiglu import silu_mul, silu_mul_backward, silu_mul_forward
from tests.kernels.launches import spy_launches
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


def test_refuses_operands_of_two_shapes_or_another_dtype():
    with pytest.raises(ValueError, match="one shape"):
        silu_mul(torch.ones(2, 8), torch.ones(2, 9))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        silu_mul(torch.ones(2, 8, dtype=torch.float64), torch.ones(2, 8, dtype=torch.float64))


# --- the launches, by hand ---------------------------------------------------------------------


def _spy_launches(monkeypatch) -> list:
    """The two kernels replaced by recorders of (name, grid, args, kwargs): nothing runs."""
    import mxrl.kernels.triton_swiglu as ts

    return spy_launches(monkeypatch, ts, ("silu_mul_fwd_kernel", "silu_mul_bwd_kernel"))


@pytest.mark.parametrize(
    ("n", "block", "blocks"),
    [(1, 16, 1), (17, 32, 1), (64, 64, 1), (65, 128, 1), (1024, 1024, 1), (1025, 1024, 2),
     (3000, 1024, 3)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_launches_by_hand(monkeypatch, dtype, n, block, blocks):
    """(row, column block) programs, a block the row's next power of two from 16 to 1024, four
    warps, libdevice's exp unless under the interpreter; the outputs contiguous [M, N] in the
    operands' dtype, on their device, each row's stride passed."""
    from mxrl.kernels.backend import triton_interpreter_enabled

    launches = _spy_launches(monkeypatch)
    gate_up = torch.ones(3, 2 * n, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # rows of stride 2n, columns contiguous: no copy
    out = silu_mul(gate, up)
    dout = torch.ones(3, n, dtype=dtype)
    dgate, dup = silu_mul_backward(dout, gate, up)
    for t in (out, dgate, dup):
        assert t.dtype == dtype and t.shape == (3, n) and t.is_contiguous()
    assert dgate.data_ptr() != dup.data_ptr()
    (fwd, grid, args, kw), (bwd, bgrid, bargs, bkw) = launches
    assert (fwd, grid) == ("silu_mul_fwd_kernel", (3, blocks))
    assert (bwd, bgrid) == ("silu_mul_bwd_kernel", (3, blocks))
    assert args[0] is gate and args[1] is up and args[2].data_ptr() == out.data_ptr()
    assert args[3:] == (n, 2 * n, 2 * n, n)
    assert bargs[0] is dout and bargs[3] is dgate and bargs[4] is dup
    assert bargs[5:] == (n, n, 2 * n, 2 * n, n, n)
    for k in (kw, bkw):
        assert k == {
            "BLOCK": block, "IS_BF16": dtype == torch.bfloat16,
            "LIBDEVICE": not triton_interpreter_enabled(), "num_warps": 4,
        }  # fmt: skip


def test_no_rows_or_no_columns_launch_nothing(monkeypatch):
    launches = _spy_launches(monkeypatch)
    for m, n in ((0, 8), (3, 0)):
        gate = torch.ones(m, n)
        assert silu_mul_forward(gate, gate).shape == (m, n)
        assert [t.shape for t in silu_mul_backward(gate, gate, gate)] == [(m, n), (m, n)]
    assert launches == []


@interpreter
def test_operands_in_another_layout():
    """gate and up whose last dim is not contiguous (a 2-row transposed view, stride 2), and such
    a gradient, are copied once and give the contiguous operands' bytes."""
    gate, up, dout = operands(2, 40, torch.float32, seed=4)
    views = [t.t().contiguous().t().requires_grad_(i < 2) for i, t in enumerate((gate, up, dout))]
    assert all(v.stride() == (1, 2) for v in views)
    g_t, u_t, d_t = views
    out_t = silu_mul(g_t, u_t)
    out_t.backward(d_t)
    g_c, u_c = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out_c = silu_mul(g_c, u_c)
    out_c.backward(dout)
    assert_bytes_equal(out_t, out_c, "out")
    assert_bytes_equal(g_t.grad, g_c.grad, "dgate")
    assert_bytes_equal(u_t.grad, u_c.grad, "dup")


@interpreter
def test_a_vector():
    """A 1-D gate and up are one row."""
    gate, up, dout = operands(1, 40, torch.bfloat16, seed=5)
    g1, u1 = gate[0].clone().requires_grad_(), up[0].clone().requires_grad_()
    out = silu_mul(g1, u1)
    out.backward(dout[0])
    assert out.shape == (40,)
    assert_bytes_equal(out, silu_mul_forward(gate, up)[0], "out")
    dgate, dup = silu_mul_backward(dout, gate, up)
    assert_bytes_equal(g1.grad, dgate[0], "dgate")
    assert_bytes_equal(u1.grad, dup[0], "dup")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_reference_is_within_the_forwards_bound(dtype):
    """The eager ops (`silu_mul_reference`, what the models run without the kernels) within the
    bound the kernel's output keeps to float64."""
    from mxrl.kernels.swiglu import silu_mul_reference

    gate, up, dout = operands(5, 96, dtype, seed=6)
    out64 = exact(gate, up, dout)[0]
    rel = (1 + E) * (1 + UNIT[dtype]) ** 2 * (1 + U) - 1
    check_within(silu_mul_reference(gate, up), out64, rel * out64.abs(), "reference")
