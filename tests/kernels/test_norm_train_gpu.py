"""The trainer's fused RMSNorm (mxrl.kernels.norm_train) compiled on a GPU, at the widths of
Qwen3-30B-A3B (hidden 2048, head dim 128) and odd ones: the forward the engine kernel's bytes,
dx and dweight within the docstring's bounds against float64 autograd, a row's dx the same
bytes whatever the batch, dweight the same bytes run to run, and a training step of the tiny MoE
with the fused norms close to the eager one. No float64 gradcheck: the kernels compute in fp32
for fp32 / bf16 / fp16 inputs only (float64 is refused), so the float64 comparison is the bound
check. Interpreter tier: tests/kernels/test_norm_train.py."""

from __future__ import annotations

import pytest
import torch

from mxrl.kernels.norm_train import rms_norm_backward, rms_norm_forward, rms_norm_train
from mxrl.kernels.rowwise import rms_norm
from tests.kernels.test_norm_train import (
    DTYPES,
    EPS,
    check_within,
    dw_bound,
    dx_bound,
    exact,
    inputs,
)
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
WIDTHS = [2048, 1536, 128, 96]


def cuda_inputs(rows, h, x_dtype, w_dtype, seed=0):
    return tuple(t.to(CUDA) for t in inputs(rows, h, x_dtype, w_dtype, seed))


@pytest.mark.parametrize("h", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_gives_the_engine_kernels_bytes(dtype, h):
    x, w, _ = cuda_inputs(4096, h, dtype, dtype)
    out, _ = rms_norm_forward(x, w, EPS)
    assert_bytes_equal(out, rms_norm(x, w, EPS), "out")


@pytest.mark.parametrize("h", [2048, 128])
def test_forward_under_fp32_weights_scales_the_engines_normalised_bytes(h):
    x, w, _ = cuda_inputs(1024, h, torch.bfloat16, torch.float32)
    y = rms_norm(x, torch.ones(h, dtype=x.dtype, device=CUDA), EPS)
    assert_bytes_equal(rms_norm_forward(x, w, EPS)[0], w * y.float(), "out")


@pytest.mark.parametrize("h", WIDTHS)
@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
def test_gradients_are_within_the_stated_bounds(x_dtype, w_dtype, h):
    x, w, g = cuda_inputs(4096 if h >= 1024 else 32768, h, x_dtype, w_dtype, seed=h)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm_train(xr, wr, EPS).backward(g)
    r, dx, dw = exact(x, w, g)
    check_within(xr.grad, dx, dx_bound(x, w, g, r, dx), "dx")
    check_within(wr.grad, dw, dw_bound(x, w, g, r, dw), "dw")


@pytest.mark.parametrize("h", [2048, 128])
@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
def test_a_rows_dx_does_not_depend_on_the_batch(x_dtype, w_dtype, h):
    """Batches of 1, 7 and 5000 rows (other program splits, other tile positions)."""
    x, w, g = cuda_inputs(5000, h, x_dtype, w_dtype, seed=1)
    _, rstd = rms_norm_forward(x, w, EPS)
    dx, _ = rms_norm_backward(g, x, w, rstd)
    for start, n in ((0, 1), (3, 7), (4999, 1), (1234, 1)):
        part = slice(start, start + n)
        _, rstd_part = rms_norm_forward(x[part], w, EPS)
        assert_bytes_equal(rstd_part, rstd[part], f"rstd {start}+{n}")
        alone = rms_norm_backward(g[part], x[part], w, rstd_part)[0]
        assert_bytes_equal(alone, dx[part], f"dx {start}+{n}")


@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
def test_dweight_is_the_same_bytes_run_to_run(x_dtype, w_dtype):
    x, w, g = cuda_inputs(16384, 2048, x_dtype, w_dtype, seed=2)
    _, rstd = rms_norm_forward(x, w, EPS)
    first = rms_norm_backward(g, x, w, rstd)
    for _ in range(3):
        again = rms_norm_backward(g, x, w, rstd)
        assert_bytes_equal(again[0], first[0], "dx")
        assert_bytes_equal(again[1], first[1], "dw")


def test_no_rows():
    x = torch.empty(0, 2048, dtype=torch.bfloat16, device=CUDA, requires_grad=True)
    w = torch.ones(2048, device=CUDA, requires_grad=True)
    rms_norm_train(x, w, EPS).sum().backward()
    assert x.grad.shape == x.shape
    assert_bytes_equal(w.grad, torch.zeros_like(w), "dw")


def test_a_training_step_of_the_tiny_model_with_fused_norms():
    """fp32 master weights, bf16 autocast (the trainer's setting): every norm, RoPE and the MoE
    permutation fused by default on CUDA; loss and gradients close to the eager reference's.
    The fused run replays the reference's routing: through 4 layers of bf16 compute a norm's
    bytes (within its bound) can flip a token's experts, which moves the router's gradient
    without anything being wrong (without replay, layer 2's router gradient was 19% away on an
    H100 at af3bdac). With the same experts, a tenth of each gradient's norm is far above the
    bounds carried through the layers, far below a wrong gradient."""
    from mxrl.arch import builtin_config
    from mxrl.kernels import Backend, Kernels
    from mxrl.models import RMSNorm, build_model
    from mxrl.nn import apply_plan
    from mxrl.recipe import resolve

    ids = torch.randint(1, 64, (4, 65), generator=torch.Generator().manual_seed(0)).to(CUDA)
    results, replay = [], None
    for backend in ("reference", None):
        model = build_model(builtin_config("tiny-moe"), seed=0, device="cuda")
        plan = resolve("bf16", {n: p.shape for n, p in model.named_parameters()})
        apply_plan(model, plan, backend=Kernels.resolve(backend, CUDA))
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        want = Backend.REFERENCE if backend else Backend.TRITON
        assert norms and all(m.rowwise is want for m in norms)
        model.set_training_options(compute_dtype=torch.bfloat16)
        logits, routing = model(ids[:, :-1], return_routing=True, replay_routing=replay)
        replay = routing
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0)
    for name, g in ref_grads.items():
        if g is None:
            assert grads[name] is None, name
            continue
        diff = (grads[name].double() - g.double()).norm()
        assert diff <= 0.1 * g.double().norm() + 1e-12, (name, diff.item(), g.norm().item())
