"""The trainer's MoE permutation kernels (mxrl.kernels.moe_train) and their references: the
references against an independent float32 computation (numpy) and against autograd, the kernels
against the references byte for byte (the routing weights' gradient within its stated bound),
under Triton's interpreter and (`gpu`) on CUDA; the grouped experts through the fused layout
give the reference layout's bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxrl.kernels import moe_train as mt
from mxrl.nn.paths.permute import ExpertLayout
from tests.kernels.launches import spy_launches
from tests.kernels.test_decode_gemm import interpreter
from tests.numerics import assert_bytes_equal

BF16 = torch.bfloat16


def _case(t=5, k=4, h=40, e=6, device="cpu", seed=0, zeros=False):
    """A routing of t tokens over e experts (k distinct each), the down projection's bf16 rows
    in sorted order, bf16 routing weights, an fp32 gradient of the combined output; `zeros`:
    signed zeros in h, w and the gradient."""
    g = torch.Generator().manual_seed(seed)
    e = max(e, k)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    layout = ExpertLayout.build(ids, e)
    h = (torch.randn(t * k, h, generator=g) * 3).to(BF16)
    w = torch.rand(t, k, generator=g).to(BF16)
    grad = torch.randn(t, h.shape[1], generator=g)
    if zeros:
        h[::3] = -0.0
        w[0, 0] = 0.0
        grad[1] = -0.0
        grad[2, ::2] = 0.0
    return [x.to(device) for x in (h, w, grad, layout.inverse)]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16 if t.dtype == BF16 else torch.int32).cpu().numpy()


# --- the references ------------------------------------------------------------------------------


def test_unpermute_reference_is_the_slot_order_float32_sum():
    """Computed again with numpy's float32 (a second library): each bf16 product (exact in
    float32, rounded once to bf16 by torch), then acc = acc + p_j from +0 in slot order."""
    h, w, _, inv = _case(t=7, k=8, h=33)
    t, k = w.shape
    p = (h.index_select(0, inv).view(t, k, -1).float() * w.float()[..., None]).to(BF16)
    acc = np.zeros((t, h.shape[1]), np.float32)
    for j in range(k):
        acc = acc + p[:, j].float().numpy()
    want = torch.from_numpy(acc).to(BF16)
    assert_bytes_equal(mt.unpermute_reference(h, w, inv), want, "out")


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows", [torch.float32, BF16])
def test_permute_backward_reference_is_the_slot_order_float32_sum(dtype, rows):
    """At a width where eager `sum(1)` of fp32 adds the slots in another order on the CPU."""
    h, _, _, inv = _case(t=16, k=8, h=3000, e=9)
    g = (h.float() * 1.37).to(rows)
    t, k = 16, 8
    g_Tk = g.index_select(0, inv).view(t, k, -1).to(dtype).float().numpy()
    acc = np.zeros((t, g.shape[1]), np.float32)
    for j in range(k):
        acc = acc + g_Tk[:, j]
    want = torch.from_numpy(acc).to(dtype)
    assert_bytes_equal(mt.permute_backward_reference(g, inv, k, dtype), want, "dx")


def test_unpermute_backward_reference_is_autograd_through_the_reference():
    h, w, grad, inv = _case(zeros=True)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    mt.unpermute_reference(hh, ww, inv).float().backward(grad)
    g_h, g_w = mt.unpermute_backward_reference(grad, h, w, inv)
    assert_bytes_equal(g_h, hh.grad, "g_h")
    assert_bytes_equal(g_w, ww.grad, "g_w")


def test_the_weight_grad_bound_is_tight_enough_to_mean_something():
    """The bound is a small fraction of the sum of the terms' magnitudes (not a pass for
    anything), and a wrong gradient (every product one bf16 ulp high) breaks it."""
    h, w, grad, inv = _case(t=6, k=4, h=2048)
    t, k = w.shape
    _, g_w = mt.unpermute_backward_reference(grad, h, w, inv)
    h_Tk = h.index_select(0, inv).view(t, k, -1)
    bound = mt.unpermute_weight_grad_bound(grad, h_Tk)
    magnitude = (grad.to(BF16).float()[:, None, :] * h_Tk.float()).abs().double().sum(-1)
    assert (bound <= 2.0**-6 * magnitude).all()
    wrong = (grad.to(BF16).float()[:, None, :] * h_Tk.float() * (1 + 2.0**-7)).to(BF16)
    wrong = wrong.float().sum(-1).to(BF16)
    assert ((wrong.double() - g_w.double()).abs() > bound).any()


def test_the_references_cast_the_weights_to_hs_dtype():
    """fp32 weights give what their bf16 roundings give (the product is bf16 times bf16)."""
    h, _, grad, inv = _case(t=4, k=2, h=24)
    w = torch.rand(4, 2, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(w, w.to(BF16).float())
    assert_bytes_equal(
        mt.unpermute_reference(h, w, inv), mt.unpermute_reference(h, w.to(BF16), inv)
    )
    got = mt.unpermute_backward_reference(grad, h, w, inv)
    want = mt.unpermute_backward_reference(grad, h, w.to(BF16), inv)
    for a, b in zip(got, want, strict=True):
        assert_bytes_equal(a, b)


def test_the_weight_grad_bound_formula_by_hand():
    """g = 1 (bf16), h = [1, 2, -4, 8]: p = h, s = 7, sum|p| = 15, H - 1 = 3: the bound is
    2 (3 * 2^-24 * 15 + 2^-8 (7 + 3 * 2^-24 * 15)). g and each product are rounded to bf16."""
    h_Tk = torch.tensor([[[1.0, 2.0, -4.0, 8.0]]], dtype=BF16)
    reorder = 3 * 2.0**-24 * 15
    want = 2 * (reorder + 2.0**-8 * (7 + reorder))
    got = mt.unpermute_weight_grad_bound(torch.ones(1, 4), h_Tk)
    assert got.shape == (1, 1) and got.item() == want
    # H = 1, g = 1 + 3 * 2^-9 rounds to 1 + 2^-7 in bf16, and p = 3 (1 + 2^-7) = 3.0234375 to
    # 3.03125 (a tie, to even); rounding neither gives 3.015625, rounding g only 3.0234375
    got = mt.unpermute_weight_grad_bound(torch.full((1, 1), 1 + 3 * 2.0**-9), h_Tk[..., 1:2] + 1)
    assert got.item() == 2 * 2.0**-8 * 3.03125


# --- the kernels ---------------------------------------------------------------------------------


def _check_kernels(device, **kw):
    h, w, grad, inv = _case(device=device, **kw)
    t, k = w.shape
    assert mt.unpermute_fits(h, w)
    assert_bytes_equal(mt.unpermute(h, w, inv), mt.unpermute_reference(h, w, inv), "out")
    g_h, g_w = mt.unpermute_backward(grad, h, w, inv)
    want_h, want_w = mt.unpermute_backward_reference(grad, h, w, inv)
    assert_bytes_equal(g_h, want_h, "g_h")
    assert g_w.dtype == BF16 and g_w.shape == (t, k)
    bound = mt.unpermute_weight_grad_bound(grad, h.index_select(0, inv).view(t, k, -1))
    assert ((g_w.double() - want_w.double()).abs() <= bound).all()
    for dtype in (torch.float32, BF16):
        for rows in (torch.float32, BF16):
            g = (h.float() * 0.71).to(rows)
            assert mt.permute_backward_fits(g, dtype)
            got = mt.permute_backward(g, inv, k, dtype)
            assert_bytes_equal(got, mt.permute_backward_reference(g, inv, k, dtype), "dx")


@interpreter
@pytest.mark.parametrize(
    ("t", "k", "h"), [(5, 4, 40), (3, 8, 1500), (4, 1, 16), (2, 2, 2048), (1, 8, 1), (2, 2, 1025)]
)
def test_kernels_give_the_references_bytes(t, k, h):
    """Widths under, over and across the 1024-column programs, k = 1 to 8."""
    _check_kernels("cpu", t=t, k=k, h=h, e=max(k, 3))


@interpreter
def test_signed_zeros_as_autograd_leaves_them():
    """-0 products come out of the combine's backward as +0 (autograd's index_add into zeros)
    and the sums start at +0, in the kernels as in the references."""
    _check_kernels("cpu", t=5, k=4, h=40, zeros=True)


@interpreter
def test_a_gradient_in_another_layout():
    """The combine's gradient as a transposed view (its last dim not contiguous: strides (1, 2)
    for 2 tokens) is copied."""
    h, w, grad, inv = _case(t=2, k=2, h=24)
    g_t = grad.t().contiguous().t()
    assert g_t.stride(-1) != 1
    got = mt.unpermute_backward(g_t, h, w, inv)
    want = mt.unpermute_backward_reference(grad, h, w, inv)
    assert_bytes_equal(got[0], want[0], "g_h")


@interpreter
def test_no_tokens_launch_nothing():
    h = torch.zeros(0, 8, dtype=BF16)
    w = torch.zeros(0, 2, dtype=BF16)
    inv = torch.zeros(0, dtype=torch.int64)
    assert mt.unpermute(h, w, inv).shape == (0, 8)
    g_h, g_w = mt.unpermute_backward(torch.zeros(0, 8), h, w, inv)
    assert g_h.shape == (0, 8) and g_w.shape == (0, 2)
    assert mt.permute_backward(h, inv, 2, torch.float32).shape == (0, 8)


def test_what_the_kernels_take():
    h, w, _, _ = _case()
    assert mt.unpermute_fits(h, w)
    assert not mt.unpermute_fits(h.float(), w)  # bf16 rows only (the grouped GEMMs' output)
    assert not mt.unpermute_fits(h, w.float())
    assert not mt.unpermute_fits(h[:-1], w)
    assert not mt.unpermute_fits(h.t(), w)
    assert not mt.unpermute_fits(torch.zeros(4, 16385, dtype=BF16), w[:1])
    assert mt.unpermute_fits(torch.zeros(4, 16384, dtype=BF16), w[:1])
    assert not mt.unpermute_fits(torch.zeros(4, 0, dtype=BF16), w[:1])
    assert mt.permute_backward_fits(h, torch.float32)
    assert not mt.permute_backward_fits(h.half(), torch.float32)
    assert not mt.permute_backward_fits(h, torch.float16)
    assert not mt.permute_backward_fits(h.t(), torch.float32)


def test_the_launches(monkeypatch):
    """No contraction; the combine and the gather's backward over (token, 1024-column block)
    programs, the combine's backward one program a token over its whole row."""
    import mxrl.kernels.triton_moe_train as tk

    names = ("unpermute_kernel", "unpermute_backward_kernel", "permute_backward_kernel")
    launches = spy_launches(monkeypatch, tk, names)
    for hdim, blocks, row, warps in ((2500, 3, 4096, 8), (2048, 2, 2048, 4)):
        h, w, grad, inv = _case(t=3, k=2, h=hdim)
        mt.unpermute(h, w, inv)
        mt.unpermute_backward(grad, h, w, inv)
        mt.permute_backward(h, inv, 2, BF16)
        got = {name: (grid, kw) for name, grid, _, kw in launches}
        launches.clear()
        assert got["unpermute_kernel"][0] == (3, blocks)
        assert got["unpermute_kernel"][1]["BLOCK"] == 1024
        assert got["unpermute_backward_kernel"][0] == (3,)
        assert got["unpermute_backward_kernel"][1]["BLOCK"] == row
        assert got["unpermute_backward_kernel"][1]["num_warps"] == warps
        assert got["permute_backward_kernel"][0] == (3, blocks)
        assert got["permute_backward_kernel"][1]["OUT_BF16"] is True
        for name in ("unpermute_kernel", "permute_backward_kernel"):
            assert got[name][1]["num_warps"] == 4
        for _, kw in got.values():
            assert kw["enable_fp_fusion"] is False and kw["K"] == 2


# --- through the model's grouped experts ---------------------------------------------------------


def _experts_run(fused: bool, device: str, dtype=torch.float32):
    from mxrl.kernels import Backend, Gemm
    from mxrl.nn.experts import GroupedExperts
    from mxrl.nn.paths.grouped import grouped_experts_forward
    from tests.nn.test_gather_rows import set_gemm

    torch.manual_seed(0)
    experts = GroupedExperts(6, 64, 32, dtype=dtype).to(device)
    experts.reset_parameters(0.1)
    set_gemm(experts, Gemm.TENSOR_CORE)
    experts.rowwise = Backend.TRITON if fused else Backend.REFERENCE
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 64, generator=g).to(device, dtype).requires_grad_(True)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(9)]).to(device)
    w = torch.rand(9, 3, generator=g).to(device, dtype).requires_grad_(True)
    out = grouped_experts_forward(experts, x, ids, w)
    out.backward(torch.randn(out.shape, generator=g).to(device, dtype))
    grads = [x.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    return out.detach(), grads, w.grad


def _check_experts(device, dtype=torch.float32):
    out, grads, g_w = _experts_run(True, device, dtype)
    want_out, want_grads, want_w = _experts_run(False, device, dtype)
    assert_bytes_equal(out, want_out, "out")
    for name, a, b in zip(("x", "gate_up", "down"), grads, want_grads, strict=True):
        assert_bytes_equal(a, b, name)
    assert torch.allclose(g_w.float(), want_w.float(), rtol=2.0**-6, atol=1e-6)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_grouped_experts_fused_are_the_reference_layouts_bytes(dtype):
    """All but the routing weights' gradient byte for byte (it is within the bound above),
    under fp32 and bf16 masters."""
    _check_experts("cpu", dtype)


@interpreter
@pytest.mark.parametrize("fused", [True, False])
def test_the_layout_runs_the_kernels_exactly_when_fused(monkeypatch, fused):
    """With the row-wise kernels Triton, each of the three launches once per layer pass; with
    the reference, none (the references instead); a layout is unfused unless asked."""
    calls = []
    for name in ("unpermute", "unpermute_backward", "permute_backward"):
        for fn in (name, f"{name}_reference"):
            real = getattr(mt, fn)
            monkeypatch.setattr(mt, fn, lambda *a, _f=fn, _real=real: calls.append(_f) or _real(*a))
    _experts_run(fused, "cpu")
    names = ("unpermute", "permute_backward", "unpermute_backward")
    want = names if fused else tuple(f"{n}_reference" for n in names)
    assert sorted(calls) == sorted(want)
    assert not ExpertLayout.build(torch.tensor([[0, 1]]), 2).fused


@pytest.mark.gpu
def test_on_cuda_the_references_bytes():
    """The compiled kernels at the model's width, and the grouped experts end to end."""
    _check_kernels("cuda", t=64, k=8, h=2048, e=16)
    _check_kernels("cuda", t=5, k=4, h=40, zeros=True)
    _check_experts("cuda")
