"""QLinear / QExperts numerics, bit for bit: the forward is the exact emulated GEMM of the
dequantized operands times the global scales; each backward mode multiplies exactly the operands
docs/design.md §7 names. Expected values are built from mxrl.formats directly, not from mxrl.nn."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mxrl.formats import decode_global_scale, dequantize, quantize
from mxrl.kernels import Gemm
from mxrl.nn import GroupedExperts, QExperts, QLinear
from mxrl.recipe import TensorSpec
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

T, N, K = 64, 96, 128


def spec(fmt, name="model.layers.0.mlp.down_proj.weight", shape=(N, K), **kw) -> TensorSpec:
    extra = {"activations": "per_token"} if fmt == "nvfp4" else {}
    if fmt == "fp8_block":
        extra["block"] = (128, 128)
    extra.update(kw)
    return TensorSpec(
        name=name,
        shape=shape,
        kind="dense_mlp",
        layer=0,
        expert=None,
        role=name.split(".")[-2].removesuffix("_proj"),
        format=fmt,
        **extra,
    )


def act_kwargs(fmt, activations="per_token"):
    if fmt == "nvfp4":
        return {"per_token": activations == "per_token"}
    if fmt == "fp8_block":
        return {"block": (1, 128)}
    return {}


def weight_kwargs(fmt):
    return {"block": (128, 128)} if fmt == "fp8_block" else {}


def emulated(x, w, fmt, activations="per_token", w_amax=None):
    """y = (lp(Qa(x)) @ lp(Qw(w))^T) * (s_x * s_w), written out from the formats API."""
    xq = quantize(x, fmt, **act_kwargs(fmt, activations))
    wkw = weight_kwargs(fmt)
    if w_amax is not None:
        wkw["global_amax"] = w_amax
    wq = quantize(w, fmt, **wkw)
    y = dequantize(xq, global_scale=False) @ dequantize(wq, global_scale=False).t()
    s_x, s_w = decode_global_scale(xq), decode_global_scale(wq)
    if s_x is not None:
        y = y * (s_x * s_w)
    return y


def make_linear(fmt, backward="high_precision", seed=0, **spec_kw):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
    return QLinear.from_linear(lin, spec(fmt, **spec_kw), backward)


def inputs(seed=1, rows=T):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, K, generator=g), torch.randn(rows, N, generator=g)


CASES = [
    ("mxfp8", "per_token"),
    ("nvfp4", "per_token"),
    ("nvfp4", "per_tensor"),
    ("fp8_block", "per_token"),
]


@pytest.mark.parametrize(("fmt", "activations"), CASES)
def test_forward_is_the_emulated_gemm(fmt, activations):
    kw = {"activations": activations} if fmt == "nvfp4" else {}
    q = make_linear(fmt, **kw)
    x, _ = inputs()
    y = q(x)
    want = emulated(x, q.weight.detach(), fmt, activations)
    assert_bytes_equal(y, want, f"{fmt} {activations}")


def _grads(q, x, dy):
    x = x.clone().requires_grad_(True)
    q.weight.grad = None
    q(x).backward(dy)
    return x.grad, q.weight.grad


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8_block"])
def test_high_precision_backward_uses_original_operands(fmt):
    q = make_linear(fmt, "high_precision")
    x, dy = inputs()
    dx, dw = _grads(q, x, dy)
    w = q.weight.detach()
    assert_bytes_equal(dx, dy @ w, "dx")
    assert_bytes_equal(dw, dy.t() @ x, "dw")


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8_block"])
def test_dequantized_backward_uses_the_forward_operands(fmt):
    q = make_linear(fmt, "dequantized")
    x, dy = inputs()
    dx, dw = _grads(q, x, dy)
    w = q.weight.detach()
    w_deq = dequantize(quantize(w, fmt, **weight_kwargs(fmt)))
    x_deq = dequantize(quantize(x, fmt, **act_kwargs(fmt)))
    assert_bytes_equal(dx, dy @ w_deq, "dx")
    assert_bytes_equal(dw, dy.t() @ x_deq, "dw")


def test_quantized_backward_mxfp8_row_and_column_copies_from_high_precision():
    q = make_linear("mxfp8", "quantized")
    with torch.no_grad():  # columns spanning 2^-14..1: row blocks push small ones to subnormals
        q.weight.mul_(2.0 ** -torch.arange(K).remainder(15).float())
    x, dy = inputs()
    dx, dw = _grads(q, x, dy)
    w = q.weight.detach()
    dy_row = dequantize(quantize(dy, "mxfp8"))  # blocks along N, dx's reduction dim
    w_col = dequantize(quantize(w, "mxfp8", axis=0))  # from the master, not the row copy
    dy_col = dequantize(quantize(dy, "mxfp8", axis=0))  # blocks along T, dw's reduction dim
    x_col = dequantize(quantize(x, "mxfp8", axis=0))
    assert_bytes_equal(dx, dy_row @ w_col, "dx")
    assert_bytes_equal(dw, dy_col.t() @ x_col, "dw")
    w_col_from_row = dequantize(quantize(dequantize(quantize(w, "mxfp8")), "mxfp8", axis=0))
    # Requantizing the row copy into the column copy would lose the small columns' precision
    # (E4M3 rounding is scale-invariant otherwise, so wide-range weights are needed to see it).
    assert not torch.equal(dy_row @ w_col_from_row, dx)


def test_quantized_backward_pads_tokens_with_zeros():
    """T = 50 is not a multiple of 32: the column-wise copies see zero rows, which change no
    block amax and add nothing, so dW equals the T = 64 computation with zero rows appended."""
    q = make_linear("mxfp8", "quantized")
    x, dy = inputs(rows=50)
    _, dw = _grads(q, x, dy)
    pad = torch.zeros(14, K), torch.zeros(14, N)
    _, dw_padded = _grads(q, torch.cat([x, pad[0]]), torch.cat([dy, pad[1]]))
    assert_bytes_equal(dw, dw_padded, "dw")


def _deq_col_padded(t):
    """deq of the column-wise MXFP8 copy of t [rows, C] after zero-padding rows to 32, cut back."""
    rows = t.shape[0]
    padded = torch.cat([t.float(), torch.zeros(-rows % 32, t.shape[1])])
    return dequantize(quantize(padded, "mxfp8", axis=0))[:rows]


@pytest.mark.parametrize("rows", [33, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_backward_with_padded_tokens_is_the_reference_computation(rows, dtype):
    """Odd token counts (padded to 64 and 96 for the column-wise copies), fp32 and bf16
    activations: dX and dW are the module docstring's formulas written out with the reference
    quantizers of mxrl.formats, bit for bit (the CPU quantizes on the reference backend)."""
    q = make_linear("mxfp8", "quantized")
    x, dy = inputs(seed=rows, rows=rows)
    x, dy = x.to(dtype), dy.to(dtype)
    dx, dw = _grads(q, x, dy)
    w = q.weight.detach()
    dy_row = dequantize(quantize(dy.float(), "mxfp8"))
    w_col = dequantize(quantize(w, "mxfp8", axis=0))
    assert_bytes_equal(dx, (dy_row @ w_col).to(dtype), "dx")
    assert_bytes_equal(dw, _deq_col_padded(dy).t() @ _deq_col_padded(x), "dw")


def test_quantized_backward_refuses_nvfp4():
    with pytest.raises(ValueError, match=r"quantized.*mxfp8"):
        make_linear("nvfp4", "quantized")


def test_weight_is_quantized_once_per_optimizer_step():
    q = make_linear("nvfp4")
    x, _ = inputs()
    first = q.qweight(Gemm.REFERENCE)
    q(x)
    assert q.qweight(Gemm.REFERENCE) is first  # no change, no requantization
    opt = torch.optim.SGD(q.parameters(), lr=0.1)
    q(x).sum().backward()
    opt.step()
    assert q.qweight(Gemm.REFERENCE) is not first
    assert_bytes_equal(q(x), emulated(x, q.weight.detach(), "nvfp4"), "after step")


def test_gate_and_up_share_one_global_scale():
    gate = make_linear(
        "nvfp4",
        seed=3,
        name="model.layers.0.mlp.gate_proj.weight",
        fuse_group="model.layers.0.mlp.gate_up",
    )
    up = make_linear(
        "nvfp4",
        seed=4,
        name="model.layers.0.mlp.up_proj.weight",
        fuse_group="model.layers.0.mlp.gate_up",
    )
    with torch.no_grad():
        up.weight.mul_(5.0)
    gate.set_fuse_partner(up.weight)
    up.set_fuse_partner(gate.weight)
    gate_w, up_w = gate.qweight(Gemm.REFERENCE), up.qweight(Gemm.REFERENCE)
    assert_bytes_equal(gate_w.s_dec, up_w.s_dec, "shared")
    amax = torch.maximum(gate.weight.abs().max(), up.weight.abs().max()).detach()
    x, _ = inputs()
    assert_bytes_equal(gate(x), emulated(x, gate.weight.detach(), "nvfp4", w_amax=amax), "gate")


def _experts(seed=0, e=4, h=64, i=32):
    g = torch.Generator().manual_seed(seed)
    experts = GroupedExperts(e, h, i)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(e, 2 * i, h, generator=g) * 0.05)
        experts.down_proj.copy_(torch.randn(e, h, i, generator=g) * 0.05)
        experts.gate_up_proj[1, i:] *= 4.0  # up of expert 1 is larger than its gate
    return experts


def _expert_specs(fmt, fused=True, e=4, h=64, i=32):
    base = "model.layers.0.mlp.experts"
    kw = {"activations": "per_token"} if fmt == "nvfp4" else {}
    if fmt == "fp8_block":
        kw = {"block": (128, 128)}
    gu = TensorSpec(
        name=f"{base}.gate_up_proj",
        shape=(e, 2 * i, h),
        kind="routed_expert",
        layer=0,
        expert=None,
        role="gate_up",
        format=fmt,
        fuse_group=f"{base}.gate_up_proj" if fused and fmt == "nvfp4" else None,
        **kw,
    )
    down = TensorSpec(
        name=f"{base}.down_proj",
        shape=(e, h, i),
        kind="routed_expert",
        layer=0,
        expert=None,
        role="down",
        format=fmt,
        **kw,
    )
    return gu, down


def _route(t=40, e=4, k=2, seed=5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    return torch.randn(t, 64, generator=g), ids, w


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_qexperts_forward_matches_per_expert_emulation(fmt):
    experts = _experts()
    q = QExperts.from_experts(experts, *_expert_specs(fmt), "dequantized")
    x, ids, w = _route()
    y = q(x, ids, w)
    want = torch.zeros_like(x)
    for e in range(4):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu_w = experts.gate_up_proj[e].detach()
        amax = gu_w.abs().max() if fmt == "nvfp4" else None
        gate, up = emulated(x[tok], gu_w, fmt, w_amax=amax).chunk(2, -1)
        h = torch.nn.functional.silu(gate) * up
        out = emulated(h, experts.down_proj[e].detach(), fmt, w_amax=None)
        want.index_add_(0, tok, out * w[tok, slot, None])
    torch.testing.assert_close(y, want, rtol=0, atol=1e-6)  # index_add order may differ


def test_fused_gate_up_shares_one_scale_per_expert_unfused_does_not():
    experts = _experts()
    fused = QExperts.from_experts(experts, *_expert_specs("nvfp4", fused=True), "dequantized")
    split = QExperts.from_experts(experts, *_expert_specs("nvfp4", fused=False), "dequantized")
    s_fused = fused.qweight("gate_up", Gemm.REFERENCE).s_dec
    s_split = split.qweight("gate_up", Gemm.REFERENCE).s_dec
    assert s_fused.shape == (4, 1, 1)
    assert s_split.shape == (4, 64, 1)
    assert not torch.equal(s_split[1, 0], s_split[1, 32])  # gate and up halves differ
    gate, up = experts.gate_up_proj[1].detach().chunk(2, 0)
    amax = torch.maximum(gate.abs().max(), up.abs().max())
    want = decode_global_scale(quantize(gate, "nvfp4", global_amax=amax))
    assert_bytes_equal(s_fused[1].reshape(()), want, "expert 1 fused scale")


def test_qexperts_gradients_reach_the_master_weights():
    experts = _experts()
    q = QExperts.from_experts(experts, *_expert_specs("nvfp4"), "dequantized")
    x, ids, w = _route()
    q(x.requires_grad_(True), ids, w).sum().backward()
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().sum() > 0
    assert experts.down_proj.grad is not None and x.grad is not None
