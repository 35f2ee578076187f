"""The routed experts' bf16 rows (`ExpertLayout.rows_dtype`): bf16 gate/up weights read x's rows in
bf16, so the grouped form casts x [T, H] before gathering its k copies instead of gathering
fp32 rows and casting them. The same bytes as gathering in x's dtype — forward, the input's
gradient (the k rows' bf16 gradients summed in fp32) and the weights' — on the CPU and on
CUDA."""

from __future__ import annotations

import functools

import pytest
import torch

from mxrl.kernels import Gemm
from mxrl.nn import QExperts, set_gemm
from mxrl.nn.moe import moe_grouped
from mxrl.nn.paths.grouped import _project, grouped_experts_forward
from mxrl.nn.paths.permute import ExpertLayout
from tests.nn.test_qmatmul import _expert_specs, _experts, _route
from tests.numerics import assert_bytes_equal

BF16 = torch.bfloat16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _run(experts, rows_dtype, device, seed=5):
    """y, dx and both weight gradients of the grouped form with the layout's rows in
    `rows_dtype`; returns them and the gathered rows' dtype."""
    experts.zero_grad(set_to_none=True)
    x, ids, w = (t.to(device) for t in _route(t=48, seed=seed))
    x.requires_grad_(True)
    layout = ExpertLayout.build(ids, experts.num_experts, rows_dtype)
    rows = layout.gather(x.detach())
    y = moe_grouped(x, w, layout, functools.partial(_project, experts, layout=layout))
    (y.square().sum() + y.sum()).backward()
    grads = [experts.gate_up_proj.grad, experts.down_proj.grad]
    return [y.detach(), x.grad, *grads], rows.dtype


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_rows_give_the_bytes_of_fp32_rows(device):
    experts = _experts().to(device)
    set_gemm(experts, Gemm.TENSOR_CORE)
    old, old_rows = _run(experts, None, device)
    new, new_rows = _run(experts, BF16, device)
    assert (old_rows, new_rows) == (torch.float32, BF16)
    assert old[1].dtype == torch.float32, "x's gradient stays in x's dtype"
    for name, a, b in zip(("y", "dx", "d gate_up", "d down"), new, old, strict=True):
        assert_bytes_equal(a, b, name)


def test_the_gather_casts_x_before_it_and_sums_the_gradient_in_x_dtype():
    """x [T, H] is cast once (T rows), not its R = T*k gathered copies; the backward sums each
    token's k bf16 rows in fp32: a bf16 sum, rounded to bf16 at the end, gives other bytes."""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    ids = torch.tensor([[1, 0], [0, 1]])
    layout = ExpertLayout.build(ids, 2, BF16)
    casts = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                casts.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    with Count():
        rows = layout.gather(x)
    assert rows.dtype == BF16 and casts == [(2, 2)]
    # gradients of the 4 rows: token 0's two rows 1 and 2^-9 (a bf16 sum would round 1 + 2^-9
    # to 1), token 1's 3 and 5
    g = torch.tensor([[1.0, 1.0], [2.0**-9, 2.0**-9], [3.0, 3.0], [5.0, 5.0]], dtype=BF16)
    g_sorted = g[layout.inverse.argsort()]  # rows in the sorted order the gather returned
    rows.backward(g_sorted)
    assert x.grad.dtype == torch.float32
    assert x.grad.tolist() == [[1.0 + 2.0**-9] * 2, [8.0, 8.0]]


def test_quantized_gate_up_takes_the_tokens_and_bf16_gate_up_takes_bf16_rows():
    """bf16 gate/up weights: x's rows gathered in bf16; MXFP8 ones: nothing gathered, the
    projection takes x's tokens (`ExpertLayout.gate_up_tokens`, tests/nn/test_gate_up_tokens.py)."""
    seen = []

    def spy(layout_build):
        @functools.wraps(layout_build)
        def build(ids, e, rows_dtype=None, fused=False, *, gate_up_tokens=False):
            seen.append((rows_dtype, gate_up_tokens))
            return layout_build(ids, e, rows_dtype, fused, gate_up_tokens=gate_up_tokens)

        return build

    x, ids, w = _route()
    for experts in (
        _experts(),
        QExperts.from_experts(_experts(), *_expert_specs("mxfp8"), "dequantized"),
    ):
        set_gemm(experts, Gemm.TENSOR_CORE)
        original = ExpertLayout.build
        ExpertLayout.build = spy(original)
        try:
            grouped_experts_forward(experts, x, ids, w)
        finally:
            ExpertLayout.build = original
    assert seen == [(BF16, False), (None, True)]
