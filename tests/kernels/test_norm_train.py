"""The trainer's fused RMSNorm (mxrl.kernels.norm_train) under Triton's interpreter: the forward
the engine kernel's bytes, dx and dweight within the bounds its docstring derives against the
exact gradient (float64 autograd of the reference's math), a row's dx independent of the batch
bit for bit, and the model's RMSNorm running it where apply_plan is given the triton row-wise
kernels. The CUDA tier: tests/kernels/test_norm_train_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch

from mxrl.kernels import norm_train
from mxrl.kernels.norm_train import (
    rms_norm_backward,
    rms_norm_forward,
    rms_norm_train,
    rms_norm_train_reference,
)
from mxrl.kernels.rowwise import rms_norm
from tests.kernels.launches import spy_launches
from tests.kernels.test_decode_gemm import interpreter
from tests.numerics import assert_bytes_equal

EPS = 1e-6
U = 2.0**-24
UNIT = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# (x dtype, weight dtype): the engine's bf16, fp32, bf16 activations under fp32 weights (q/k
# norms under autocast with fp32 master weights) and fp32 ones under bf16 weights (the fp32
# residual stream under bf16 parameters)
DTYPES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
]


def inputs(rows, h, x_dtype, w_dtype, seed=0):
    """x with rows of very different scales, w around 1, g in the output's dtype."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, generator=gen) * torch.rand(rows, 1, generator=gen).mul(8).add(1e-3)
    w = torch.randn(h, generator=gen) * 0.5 + 1
    g = torch.randn(rows, h, generator=gen) * torch.rand(rows, 1, generator=gen).mul(4)
    out_dtype = torch.promote_types(x_dtype, w_dtype)
    return x.to(x_dtype), w.to(w_dtype), g.to(out_dtype)


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


def rho(h: int) -> float:
    """The bound on 1/rms's relative error (norm_train's docstring)."""
    return (1 + U) / ((1 - U) * math.sqrt(1 - gamma(h + 2))) - 1


def exact(x, w, g):
    """float64 autograd of w * x / sqrt(mean(x^2) + eps), eps as the kernel receives it (fp32):
    the reference's math without its roundings. (r, dx, dw)."""
    eps32 = float(torch.tensor(EPS, dtype=torch.float32))
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    r = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps32)
    dx, dw = torch.autograd.grad(w64 * (x64 * r), (x64, w64), g.double())
    return r.detach(), dx, dw


def dx_bound(x, w, g, r, dx):
    h = x.shape[-1]
    a = (g.double() * w.double()).abs()
    c = r * (a * x.double().abs()).sum(-1, keepdim=True) / h
    rh, gh, ud = rho(h), gamma(h + 2), UNIT[x.dtype]
    first = r * a * (rh + 3 * U) + r * r * x.double().abs() * c * (3 * rh + gh + 5 * U)
    return ud * dx.abs() + (1 + ud) * (1 + 2 * (rh + gh)) * first


def dw_bound(x, w, g, r, dw):
    rows, h = x.shape
    uw = UNIT[w.dtype]
    e = (1 + rho(h)) * (1 + U) ** 2 * (1 + UNIT[x.dtype]) - 1
    mag = (g.double() * x.double() * r).abs().sum(0)
    return uw * dw.abs() + (1 + uw) * (e + gamma(max(rows - 1, 0)) * (1 + e)) * mag


def check_within(got, want, bound, what):
    err = (got.double() - want).abs()
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert (err <= bound).all(), f"{what}: error up to {worst:.3g} of the bound"


@interpreter
@pytest.mark.parametrize("h", [2048, 1536, 96, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_gives_the_engine_kernels_bytes(dtype, h):
    x, w, _ = inputs(7, h, dtype, dtype)
    out, _ = rms_norm_forward(x, w, EPS)
    assert_bytes_equal(out, rms_norm(x, w, EPS), "out")


@interpreter
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_forward_under_fp32_weights_scales_the_engines_normalised_bytes(x_dtype):
    """out = w * y in fp32, y the engine's normalised x (its kernel with a weight of ones,
    whose product leaves y as it is)."""
    x, w, _ = inputs(5, 96, x_dtype, torch.float32)
    y = rms_norm(x, torch.ones(96, dtype=x_dtype), EPS)
    out, _ = rms_norm_forward(x, w, EPS)
    assert_bytes_equal(out, w * y.float(), "out")


@interpreter
@pytest.mark.parametrize("h", [2048, 96])
def test_saved_rstd_is_within_its_bound(h):
    x, w, _ = inputs(6, h, torch.float32, torch.float32)
    _, rstd = rms_norm_forward(x, w, EPS)
    r = exact(x, w, torch.zeros_like(x))[0][:, 0]
    assert ((rstd.double() - r).abs() <= rho(h) * r).all()


@interpreter
@pytest.mark.parametrize("h", [2048, 1536, 96])
@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
def test_gradients_are_within_the_stated_bounds(x_dtype, w_dtype, h):
    x, w, g = inputs(9, h, x_dtype, w_dtype, seed=h)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = rms_norm_train(xr, wr, EPS)
    out.backward(g)
    assert xr.grad.dtype == x_dtype and wr.grad.dtype == w_dtype
    r, dx, dw = exact(x, w, g)
    check_within(xr.grad, dx, dx_bound(x, w, g, r, dx), "dx")
    check_within(wr.grad, dw, dw_bound(x, w, g, r, dw), "dw")


@interpreter
def test_the_bounds_hold_across_several_steps_and_programs(monkeypatch):
    """Few programs (two), each looping over several BLOCK_R-row steps, the last one partial."""
    monkeypatch.setattr(norm_train, "_MAX_BWD_PROGRAMS", 2)
    x, w, g = inputs(83, 96, torch.bfloat16, torch.float32, seed=5)
    block_r, per_program, programs = norm_train.backward_split(83, 96)
    assert (block_r, programs) == (16, 2) and per_program == 48
    _, rstd = rms_norm_forward(x, w, EPS)
    dx_got, dw_got = rms_norm_backward(g, x, w, rstd)
    r, dx, dw = exact(x, w, g)
    check_within(dx_got, dx, dx_bound(x, w, g, r, dx), "dx")
    check_within(dw_got, dw, dw_bound(x, w, g, r, dw), "dw")
    # each row's dx is the bytes it has in a launch of many programs
    monkeypatch.setattr(norm_train, "_MAX_BWD_PROGRAMS", 1024)
    assert_bytes_equal(rms_norm_backward(g, x, w, rstd)[0], dx_got, "dx")


@interpreter
@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
def test_a_rows_dx_does_not_depend_on_the_batch(x_dtype, w_dtype):
    x, w, g = inputs(21, 256, x_dtype, w_dtype, seed=2)
    _, rstd = rms_norm_forward(x, w, EPS)
    dx, _ = rms_norm_backward(g, x, w, rstd)
    for r in (0, 7, 20):
        alone = rms_norm_backward(g[r : r + 1], x[r : r + 1], w, rstd[r : r + 1])[0]
        assert_bytes_equal(alone, dx[r : r + 1], f"row {r}")
    # per-head norms ([T, N, D] rows of D): one head alone
    heads = x.view(21, 2, 128).requires_grad_()
    rms_norm_train(heads, w[:128], EPS).backward(g.view(21, 2, 128))
    head = x[3, 128:][None].clone().requires_grad_()
    rms_norm_train(head, w[:128], EPS).backward(g[3, 128:][None])
    assert_bytes_equal(heads.grad[3, 1], head.grad[0], "a head")


@interpreter
def test_dweight_is_the_same_bytes_run_to_run():
    x, w, g = inputs(40, 96, torch.bfloat16, torch.bfloat16, seed=3)
    _, rstd = rms_norm_forward(x, w, EPS)
    first = rms_norm_backward(g, x, w, rstd)
    second = rms_norm_backward(g, x, w, rstd)
    assert_bytes_equal(second[0], first[0], "dx")
    assert_bytes_equal(second[1], first[1], "dw")


@interpreter
@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
def test_no_rows(x_dtype, w_dtype):
    x = torch.empty(0, 3, 64, dtype=x_dtype, requires_grad=True)
    w = torch.ones(64, dtype=w_dtype, requires_grad=True)
    out = rms_norm_train(x, w, EPS)
    assert out.shape == (0, 3, 64) and out.dtype == torch.promote_types(x_dtype, w_dtype)
    out.sum().backward()
    assert x.grad.shape == x.shape
    assert_bytes_equal(w.grad, torch.zeros(64, dtype=w_dtype), "dw")


def test_refuses_a_weight_of_another_length():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_train(torch.ones(2, 64), torch.ones(32), EPS)


def test_the_reference_is_the_models_eager_norm():
    from mxrl.models.layers import RMSNorm

    x, w, _ = inputs(4, 32, torch.bfloat16, torch.bfloat16)
    norm = RMSNorm(32, EPS, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(w)
    assert_bytes_equal(rms_norm_train_reference(x, w, EPS), norm(x), "out")


# --- the model's RMSNorm --------------------------------------------------------------------------


def _tiny_with_plan(backend):
    from mxrl.arch import builtin_config
    from mxrl.models import RMSNorm, build_model
    from mxrl.nn import apply_plan
    from mxrl.recipe import resolve

    model = build_model(builtin_config("tiny-moe"), seed=0)
    plan = resolve("bf16", {n: p.shape for n, p in model.named_parameters()})
    apply_plan(model, plan, backend=backend)
    return model, [m for m in model.modules() if isinstance(m, RMSNorm)]


@interpreter
def test_apply_plan_fuses_the_norms_where_the_rowwise_kernels_are_triton():
    from mxrl.kernels import Backend, Kernels
    from mxrl.models.layers import ApplyRope

    def ropes(model):
        return [m for m in model.modules() if isinstance(m, ApplyRope)]

    model, norms = _tiny_with_plan(Kernels.resolve("triton", "cpu"))
    assert len(norms) == 4 * 4 + 1  # per layer: input, post-attention, q and k; the final norm
    assert all(m.rowwise is Backend.TRITON for m in norms)
    assert len(ropes(model)) == 4 and all(m.rowwise is Backend.TRITON for m in ropes(model))
    # the reference record, a backend by name (the quantizer only) and the CPU default: eager
    for backend in (Kernels.resolve("reference", "cpu"), "triton", "reference", None):
        model, norms = _tiny_with_plan(backend)
        assert all(m.rowwise is Backend.REFERENCE for m in norms + ropes(model)), backend


@interpreter
@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
def test_a_fused_module_runs_the_kernels(x_dtype, w_dtype):
    from mxrl.kernels import Backend
    from mxrl.models import RMSNorm

    x, w, g = inputs(3 * 5, 96, x_dtype, w_dtype, seed=4)
    norm = RMSNorm(96, EPS, dtype=w_dtype)
    norm.rowwise = Backend.TRITON
    with torch.no_grad():
        norm.weight.copy_(w)
    xr = x.view(3, 5, 96).clone().requires_grad_()
    out = norm(xr)
    out.backward(g.view(3, 5, 96))
    want, rstd = rms_norm_forward(x, w, EPS)
    dx, dw = rms_norm_backward(g, x, w, rstd)
    assert_bytes_equal(out, want.view(3, 5, 96), "out")
    assert_bytes_equal(xr.grad, dx.view(3, 5, 96), "dx")
    assert_bytes_equal(norm.weight.grad, dw, "dw")


@interpreter
def test_a_training_step_of_the_tiny_model_with_fused_norms():
    """Loss and gradients of the fp32 tiny MoE with the fused norms close to the eager ones
    (fp32: the two differ by a few ulp per norm, amplified little by 4 layers)."""
    from mxrl.kernels import Kernels

    ids = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for backend in ("reference", "triton"):
        model, _ = _tiny_with_plan(Kernels.resolve(backend, "cpu"))
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-3, atol=1e-6, msg=name)


def test_a_fused_module_runs_inputs_the_kernels_do_not_take_eagerly():
    """float64 (and rows over 16384): the eager ops' bytes, no kernel launched."""
    from mxrl.kernels import Backend
    from mxrl.models import RMSNorm

    x = torch.randn(3, 32, dtype=torch.float64)
    norm = RMSNorm(32, EPS, dtype=torch.float64)
    want = norm(x)
    norm.rowwise = Backend.TRITON
    assert_bytes_equal(norm(x), want, "float64")


# --- the launches, by hand ---------------------------------------------------------------------


def _spy_launches(monkeypatch) -> list:
    """The three kernels replaced by recorders of (name, grid, args, kwargs): nothing runs."""
    import mxrl.kernels.triton_norm as tn

    names = ("rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "sum_partials_kernel")
    return spy_launches(monkeypatch, tn, names)


@pytest.mark.parametrize(
    ("h", "block", "warps", "block_r", "bwd_warps", "programs"),
    [
        (1, 16, 4, 128, 4, 1),  # the smallest block, 16 columns; 3 rows in one step
        (17, 32, 4, 64, 4, 1),
        (64, 64, 4, 32, 4, 1),
        (65, 128, 4, 16, 4, 1),
        (2048, 2048, 4, 1, 4, 3),  # a row fills the backward's 2048-element step
        (2049, 4096, 8, 1, 8, 3),  # wider: 8 warps, one row a step
    ],
)
def test_the_launches_by_hand(monkeypatch, h, block, warps, block_r, bwd_warps, programs):
    """Forward: one program a row, the row's next power of two (>= 16) as its block, 4 warps up
    to 2048 columns, 8 above; out in the promoted dtype and rstd in fp32, on x's device.
    Backward: BLOCK_R = 2048 // block rows a step (at least 1), 4 warps while a step holds at
    most 2048 elements; the partials fp32 [P, H], summed by programs of min(block, 1024)
    columns with 4 warps."""
    launches = _spy_launches(monkeypatch)
    x = torch.ones(3, h, dtype=torch.bfloat16)
    w = torch.ones(h, dtype=torch.float32)
    out, rstd = rms_norm_forward(x, w, EPS)
    assert out.dtype == torch.float32 and rstd.dtype == torch.float32 and rstd.shape == (3,)
    rms_norm_backward(out, x, w, rstd)
    (fwd, grid, args, kw), bwd, sums = launches
    assert (fwd, grid) == ("rms_norm_fwd_kernel", (3,))
    assert args[2] is out and args[3] is rstd and args[4:7] == (h, h, h)
    want = (block, warps, True, False)
    assert (kw["BLOCK"], kw["num_warps"], kw["X_BF16"], kw["OUT_BF16"]) == want
    name, grid, args, kw = bwd
    assert (name, grid) == ("rms_norm_bwd_kernel", (programs,))
    dx, part = args[4], args[5]
    assert dx.dtype == torch.bfloat16 and dx.shape == (3, h)
    assert part.dtype == torch.float32 and part.shape == (programs, h)
    assert args[6:9] == (3, h, block_r) and args[9:12] == (h, h, h)
    want = (block_r, block, bwd_warps, True)
    assert (kw["BLOCK_R"], kw["BLOCK"], kw["num_warps"], kw["X_BF16"]) == want
    name, grid, args, kw = sums
    assert (name, grid) == ("sum_partials_kernel", (-(-h // min(block, 1024)),))
    assert args[0] is part and args[1].dtype == torch.float32 and args[1].shape == (h,)
    assert args[2:4] == (programs, h)
    assert (kw["BLOCK"], kw["OUT_BF16"], kw["num_warps"]) == (min(block, 1024), False, 4)


@pytest.mark.parametrize(
    ("rows", "h", "split"),
    [
        (1, 64, (32, 32, 1)),
        (1, 4096, (1, 1, 1)),  # wider than a step: one row a step
        (3, 2048, (1, 1, 3)),
        (5000, 2048, (1, 5, 1000)),  # 5000 steps over at most 1024 programs: 5 rows each
        (83, 96, (16, 16, 6)),
    ],
)
def test_the_backward_split_by_hand(rows, h, split):
    """(BLOCK_R, rows per program, programs): BLOCK_R = max(1, 2048 // block); the steps of
    BLOCK_R rows shared by at most 1024 programs, a program's rows a whole number of steps."""
    assert norm_train.backward_split(rows, h) == split


def test_what_the_kernels_take():
    """x [..., H] and weight [H], fp32 / bf16 / fp16, H <= 16384; not a 0-d x, whatever the
    weight (a 0-d x has no rows: its H is no length)."""
    from mxrl.kernels.norm_train import fused_norm_fits

    assert fused_norm_fits(torch.empty(1, 16384), torch.empty(16384))
    assert not fused_norm_fits(torch.empty(1, 16385), torch.empty(16385))
    assert fused_norm_fits(torch.empty(2, 3, 8, dtype=torch.float16), torch.empty(8))
    assert not fused_norm_fits(torch.empty(2, 8, dtype=torch.float64), torch.empty(8))
    for w in (torch.empty(1), torch.empty(0), torch.empty(())):
        assert not fused_norm_fits(torch.tensor(1.0), w)


@interpreter
def test_x_and_its_gradient_in_another_layout():
    """A 2-row x whose last dim is not contiguous (stride 2) and a gradient laid out the same
    way are copied once, and give the contiguous inputs' bytes."""
    x, w, g = inputs(2, 96, torch.float32, torch.float32, seed=7)
    x_t = x.t().contiguous().t().requires_grad_()  # [2, 96], strides (1, 2)
    g_t = g.t().contiguous().t()
    assert x_t.stride() == (1, 2) and g_t.stride() == (1, 2)
    out_t = rms_norm_train(x_t, w, EPS)
    out_t.backward(g_t)
    x_c = x.clone().requires_grad_()
    out_c = rms_norm_train(x_c, w, EPS)
    out_c.backward(g)
    assert_bytes_equal(out_t, out_c, "out")
    assert_bytes_equal(x_t.grad, x_c.grad, "dx")
