"""The tensor-core training GEMMs (`Gemm.TENSOR_CORE`, docs/nn.md "Fast paths"), their logic on
the CPU: torch._grouped_mm runs there in bf16 (fp32 accumulation), and `mm_f32` is the fp32 GEMM
of the same bf16 values, so

- dense ops: forward and the quantized backward equal the reference bit for bit (their operands
  are exact in bf16); the high-precision backward equals the products of the bf16-rounded
  operands bit for bit;
- grouped experts: each projection, forward and both gradients, against the reference loop on
  the same inputs, within the bound of docs/nn.md (bf16 output rounding + fp32 summation order,
  + operand rounding where an operand is not exact in bf16);
- the routing layout, the 32-aligned padded layout, and no host sync in building them.
The same checks on the H200: tests/nn/test_fast_gpu.py."""

from __future__ import annotations

import pytest
import torch

from mxrl.arch import builtin_config
from mxrl.formats import dequantize, quantize
from mxrl.kernels import Backend, Gemm, Kernels
from mxrl.models import build_model
from mxrl.models.layers import LayerInputs
from mxrl.nn import GroupedExperts, QExperts, apply_plan, set_gemm
from mxrl.nn.gemm import resolved_gemm
from mxrl.nn.operands import Form
from mxrl.nn.paths.grouped import PaddedLayout
from mxrl.nn.paths.permute import ExpertLayout, _GatherTokens
from mxrl.recipe import resolve
from tests.nn.test_qmatmul import _expert_specs, _experts, _route, inputs, make_linear
from tests.numerics import HostReads, assert_bytes_equal

BF16 = torch.bfloat16
F32 = torch.float32
EXACT, ROUNDED = 0.0, 2.0**-8
# Hopper's FP8 MMA keeps about 14 bits of its running sum (DeepSeek-V3, §3.3.2): at most 128
# additions before each 128-wide block is promoted to fp32, each losing up to 2^-13 of the sum
FP8_MMA = 128 * 2.0**-13


def assert_within(fast, ref, absprod, k, operand_err, what=""):
    """|fast - ref| <= 2^-8 |ref| + (operand_err + k 2^-22) (|A| @ |B|) (docs/nn.md)."""
    bound = 2.0**-8 * ref.abs() + (operand_err + k * 2.0**-22) * absprod
    err = (fast.float() - ref).abs()
    assert (err <= bound).all(), f"{what}: max excess {(err - bound).max().item():.3e}"


# --- dense ---------------------------------------------------------------------------------


def _run(q, gemm, x, dy):
    set_gemm(q, gemm)
    q.weight.grad = None
    x = x.clone().requires_grad_(True)
    y = q(x)
    y.backward(dy)
    return y.detach(), x.grad, q.weight.grad


@pytest.mark.parametrize(
    ("fmt", "acts"), [("mxfp8", "per_token"), ("nvfp4", "per_token"), ("nvfp4", "per_tensor")]
)
@pytest.mark.parametrize("mode", ["high_precision", "dequantized", "quantized"])
def test_dense_tensor_core_forward_is_the_reference_bitwise(fmt, acts, mode):
    if fmt == "nvfp4" and mode == "quantized":
        pytest.skip("no quantized backward for nvfp4")
    kw = {"activations": acts} if fmt == "nvfp4" else {}
    q = make_linear(fmt, mode, **kw)
    x, dy = inputs()
    dy = dy.to(BF16).float()  # bf16 values: both paths quantize the same dy
    y_ref, dx_ref, dw_ref = _run(q, Gemm.REFERENCE, x, dy)
    y, dx, dw = _run(q, Gemm.TENSOR_CORE, x, dy)
    assert_bytes_equal(y, y_ref, "forward")
    if mode == "quantized":  # every backward operand is MXFP8: exact in bf16
        assert_bytes_equal(dx, dx_ref, "dx")
        assert_bytes_equal(dw, dw_ref, "dw")
    elif mode == "high_precision":  # the products of the bf16-rounded operands
        w = q.weight.detach().to(BF16).float()
        assert_bytes_equal(dx, dy @ w, "dx")
        assert_bytes_equal(dw, dy.t() @ x.to(BF16).float(), "dw")
    else:
        xq = quantize(x, fmt, per_token=acts == "per_token") if fmt == "nvfp4" else quantize(x, fmt)
        assert_bytes_equal(dw, dy.t() @ dequantize(xq).to(BF16).float(), "dw")
        assert_within(dx, dx_ref, dy.abs() @ q.weight.detach().abs(), dy.shape[1], ROUNDED, "dx")


@pytest.mark.parametrize(("fmt", "mode"), [("mxfp8", "quantized"), ("nvfp4", "dequantized")])
def test_cached_weight_keeps_only_the_packed_bytes(fmt, mode):
    """The weight cache (kept from one optimizer step to the next) holds the QTensors, not a
    bf16 copy of the weight: 8.25 / 4.5 bits per weight (+ 8.25 for MXFP8's column-wise copy)
    instead of 16 (+ 16); the GEMM operands it writes on demand equal the reference path's."""
    q = make_linear(fmt, mode)
    tw = q.qweight(Gemm.TENSOR_CORE)
    held = [tw.q] + ([tw.col()] if tw.col() is not None else [])
    numel = q.weight.numel()
    held_bytes = sum(t.nbytes for t in held) + (tw.s_dec.numel() * 4 if tw.s_dec is not None else 0)
    bits = {"mxfp8": 8.25 * len(held), "nvfp4": 4.5}[fmt]
    assert held_bytes <= numel * bits / 8 + 64, (held_bytes, numel)
    wq = q.qweight(Gemm.REFERENCE)  # the reference path's operands of the same weight (fp32)
    assert_bytes_equal(tw.operand(Form.LP, BF16), wq.operand(Form.LP, F32).to(BF16), "lp")
    assert_bytes_equal(tw.operand(Form.DEQ, BF16), wq.operand(Form.DEQ, F32).to(BF16), "deq")
    if fmt == "mxfp8":
        assert tw.col() is not None and tw.s_dec is None
        assert_bytes_equal(tw.operand(Form.COL, BF16), wq.operand(Form.COL, F32).to(BF16), "col")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_quantizing_a_weight_reads_nothing_back(fmt):
    """A training step quantizes each weight once (the cache lives until the optimizer step): an
    NVFP4 weight's global amax is weight_amax's, finite by construction, so nothing is read back
    to the host to check it (on a GPU: no sync in the step)."""
    q = make_linear(fmt, "dequantized")
    with HostReads() as reads:
        q.qweight(Gemm.TENSOR_CORE)
        q.qweight(Gemm.REFERENCE)
    assert not reads.ops, reads.ops


@pytest.mark.parametrize("preset", ["bf16", "mxfp8", "mxfp8-hp", "nvfp4-hp", "nvfp4-dequantized"])
def test_a_moe_layer_first_step_reads_nothing_back(preset):
    """Forward and backward of a MoE decoder layer on the tensor-core path, the first after an
    optimizer step (so the weights are quantized in it): no value read back to the host (on a
    GPU, no sync: tests/nn/test_fast_gpu.py checks the steps after it under CUDA's sync debug
    mode)."""
    model = build_model(builtin_config("tiny-moe"), seed=0)
    apply_plan(model, resolve(preset, {n: p.shape for n, p in model.named_parameters()}))
    set_gemm(model, Gemm.TENSOR_CORE)
    layer = model.model.layers[0]
    assert layer.is_moe
    h = torch.randn(3, 40, model.config.hidden_size, requires_grad=True)
    rope = model.model.rotary_emb(torch.arange(40)[None].expand(3, 40), h.dtype)
    with HostReads() as reads:
        out, _ = layer(h, LayerInputs(rope))
        out.float().square().mean().backward()
    assert not reads.ops, reads.ops


def test_cached_expert_weight_dequantizes_exactly():
    """A 3-D NVFP4 expert weight (decode scale per expert): the dequantized backward's bf16
    operand is the reference's fp32 deq rounded once."""
    _, q = _module("nvfp4", "dequantized")
    for which in ("gate_up", "down"):
        tw, wq = q.qweight(which, Gemm.TENSOR_CORE), q.qweight(which, Gemm.REFERENCE)
        assert tw.s_dec is not None and tw.s_dec.dim() == 3
        assert_bytes_equal(tw.operand(Form.DEQ, BF16), wq.operand(Form.DEQ, F32).to(BF16), which)


def test_dense_fp8_block_on_the_cpu_is_the_reference():
    q = make_linear("fp8_block", "high_precision")
    x, dy = inputs()
    y_ref, _, _ = _run(q, Gemm.REFERENCE, x, dy)
    y, _, _ = _run(q, Gemm.TENSOR_CORE, x, dy)
    assert_bytes_equal(y, y_ref, "fp8_block forward (emulated off CUDA)")


# --- grouped experts -------------------------------------------------------------------------


def _module(fmt, mode, device="cpu", backend="reference", e=4, h=64, i=32):
    experts = _experts(e=e, h=h, i=i).to(device)
    if fmt == "bf16":
        return experts, experts
    specs = _expert_specs(fmt, e=e, h=h, i=i)
    return experts, QExperts.from_experts(experts, *specs, mode, backend=Backend(backend))


def _loop_proj(module, which, x_sorted, layout):
    """The reference loop's projection of the sorted rows, expert by expert."""
    ends = [0, *layout.ends.tolist()]
    outs = []
    for e in range(module.num_experts):
        rows = x_sorted[ends[e] : ends[e + 1]]
        if rows.shape[0]:
            outs.append(module._gate_up(e, rows) if which == "gate_up" else module._down(e, rows))
    return torch.cat(outs)


CASES = [
    ("bf16", "high_precision"),
    ("mxfp8", "high_precision"),
    ("mxfp8", "dequantized"),
    ("mxfp8", "quantized"),
    ("nvfp4", "high_precision"),
    ("nvfp4", "dequantized"),
]


def check_grouped_projection(fmt, mode, which, device="cpu", backend="reference", size=None):
    """One grouped projection, forward and both gradients, against the reference loop on the
    same inputs (x fp32, dy bf16 values), within the bound of docs/nn.md. size: (E, H, I, T)."""
    e, h, i, t = size or (4, 64, 32, 45)
    experts, module = _module(fmt, mode, device, backend, e, h, i)
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])
    ids[: t // 6] = torch.tensor([0, 1])  # uneven groups, counts not multiples of 32
    ids[ids == 2] = 3  # expert 2 gets no row
    ids = ids.to(device)
    layout = ExpertLayout.build(ids, e)
    param = experts.gate_up_proj if which == "gate_up" else experts.down_proj
    k = param.shape[-1]
    x_sorted = torch.randn(layout.order.numel(), k, generator=g).to(device).requires_grad_(True)
    dy = torch.randn(x_sorted.shape[0], param.shape[1], generator=g).to(device, BF16)
    results = {}
    for gemm in (Gemm.REFERENCE, Gemm.TENSOR_CORE):
        param.grad = x_sorted.grad = None
        if gemm is Gemm.REFERENCE:
            y = _loop_proj(module, which, x_sorted, layout)
            y.backward(dy.float())
        else:
            y = module._grouped_proj(which, x_sorted, layout)
            assert y.dtype == BF16
            y.backward(dy)
        results[gemm] = (y.detach().float(), x_sorted.grad.clone(), param.grad.clone())
    (y_ref, dx_ref, dw_ref), (y, dx, dw) = results[Gemm.REFERENCE], results[Gemm.TENSOR_CORE]
    w = param.detach()
    if fmt == "bf16":
        absprods = _absprods(x_sorted.detach(), w, dy.float(), layout)
        errs = (ROUNDED, ROUNDED, ROUNDED)  # x, w rounded to bf16 in every GEMM
    else:
        w_deq = module.qweight(which, Gemm.REFERENCE).operand(Form.DEQ, F32)
        xs = x_sorted.detach()
        if fmt == "nvfp4":
            xq = quantize(xs, fmt, per_token=True)
        elif fmt == "fp8_block":
            xq = quantize(xs, fmt, block=(1, 128))
        else:
            xq = quantize(xs, fmt)
        x_deq = dequantize(xq)
        absprods = _absprods(x_deq, w_deq, dy.float(), layout)
        exact_bwd = mode == "quantized" or (fmt == "mxfp8" and mode == "dequantized")
        # the NVFP4 global scales multiply the bf16 output: one more rounding; block FP8 runs
        # exact code products with the fp32 block scales applied per 128-wide block (exact up
        # to fp32 roundings, inside the k 2^-22 term)
        fwd_err = ROUNDED if fmt == "nvfp4" else EXACT
        bwd_err = EXACT if exact_bwd else ROUNDED
        wgrad_err = bwd_err
        if fmt == "fp8_block" and mode == "quantized" and device == "cuda":
            wgrad_err = FP8_MMA  # the same operands' bytes, summed on the FP8 tensor cores
        errs = (fwd_err, bwd_err, wgrad_err)
        if mode == "quantized":  # operands quantized from dy: bound on those operands' sizes
            absprods = (absprods[0], 2 * absprods[1], 2 * absprods[2])
    assert_within(y, y_ref, absprods[0], k, errs[0], "forward")
    assert_within(dx, dx_ref, absprods[1], w.shape[1], errs[1], "dgrad")
    assert_within(dw, dw_ref, absprods[2], x_sorted.shape[0], errs[2], "wgrad")
    assert torch.all(dw[2] == 0), "an expert with no rows gets a zero gradient"


@pytest.mark.parametrize(("fmt", "mode"), CASES)
@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_grouped_projection_matches_the_loop_within_the_bound(fmt, mode, which):
    check_grouped_projection(fmt, mode, which)


def _absprods(x, w, dy, layout):
    """|x| @ |w_e|^T, |dy| @ |w_e| per row's expert, and sum over rows of |dy|^T |x| per expert."""
    e_of = layout.row_expert
    fwd = torch.einsum("rk,rnk->rn", x.abs(), w.abs()[e_of])
    dgrad = torch.einsum("rn,rnk->rk", dy.abs(), w.abs()[e_of])
    wgrad = torch.zeros_like(w)
    wgrad.index_add_(0, e_of, torch.einsum("rn,rk->rnk", dy.abs(), x.abs()))
    return fwd, dgrad, wgrad


@pytest.mark.parametrize(("fmt", "mode"), CASES)
def test_grouped_experts_module_runs_and_routes_like_the_loop(fmt, mode):
    """The whole module: the loop's result up to the bf16 intermediates (a re-quantized bf16
    activation may round to a neighbouring code), every parameter and the input get gradients."""
    _, module = _module(fmt, mode)
    x, ids, w = _route()
    outs = {}
    for gemm in ("reference", "tensor_core"):
        set_gemm(module, gemm)
        xg = x.clone().requires_grad_(True)
        y = module(xg, ids, w)
        y.square().sum().backward()
        outs[gemm] = (y.detach(), xg.grad)
    (y_ref, dx_ref), (y, dx) = outs["reference"], outs["tensor_core"]
    assert y.dtype == x.dtype
    rel = (y - y_ref).abs().max() / y_ref.abs().max()
    assert rel < 0.05, float(rel)
    assert (dx - dx_ref).abs().max() / dx_ref.abs().max() < 0.1


def test_layouts():
    ids = torch.tensor([[3, 0], [0, 1], [3, 1], [0, 3]])
    lay = ExpertLayout.build(ids, 5)
    assert lay.ends.tolist() == [3, 5, 5, 8, 8]
    assert lay.row_expert.tolist() == [0, 0, 0, 1, 1, 3, 3, 3]
    assert torch.equal(lay.order[lay.inverse], torch.arange(8))
    assert torch.equal(ids.reshape(-1)[lay.order], lay.row_expert)
    pad = PaddedLayout.build(lay)
    assert pad.rows % 32 == 0 and pad.rows >= 8 + 31 * 5
    assert pad.ends.tolist() == [32, 64, 64, 96, 96]
    assert pad.dest.tolist() == [0, 1, 2, 32, 33, 64, 65, 66]
    t = torch.arange(8.0)[:, None].expand(8, 4)
    assert torch.equal(pad.scatter(t)[pad.dest], t)


def test_gather_tokens_backward_sums_each_tokens_rows():
    ids = torch.tensor([[3, 0], [0, 1], [3, 1], [0, 3]])
    lay = ExpertLayout.build(ids, 4)
    x = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(8, 8)
    _GatherTokens.apply(x, lay).backward(g)
    want = torch.zeros(4, 8).index_add_(0, lay.token_of, g)
    torch.testing.assert_close(x.grad, want, rtol=0, atol=1e-6)


def test_gemm_choice():
    assert Kernels.resolve(None, "cpu").train_gemm is Gemm.REFERENCE
    assert resolved_gemm(None, torch.device("cpu")) is Gemm.REFERENCE
    assert Kernels.resolve(None, "cpu", "tensor_core").train_gemm is Gemm.TENSOR_CORE
    with pytest.raises(ValueError, match="unknown gemm"):
        Kernels.resolve(None, "cpu", "fast")
    model = build_model(builtin_config("tiny-moe"), seed=0)
    apply_plan(model, resolve("mxfp8", {n: p.shape for n, p in model.named_parameters()}))
    assert set_gemm(model, "tensor_core") > 0
    assert all(
        m.gemm_choice is Gemm.TENSOR_CORE
        for m in model.modules()
        if isinstance(m, GroupedExperts | QExperts)
    )


def test_tiny_model_trains_with_tensor_core_gemms_bf16_autocast_and_checkpointing():
    torch.manual_seed(0)
    model = build_model(builtin_config("tiny-moe"), seed=1)
    apply_plan(model, resolve("mxfp8", {n: p.shape for n, p in model.named_parameters()}))
    set_gemm(model, "tensor_core")
    model.set_training_options(compute_dtype=BF16, checkpoint_layers=True)
    model.train()
    ids = torch.randint(1, 64, (4, 24), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        logits = model(ids[:, :-1])
        assert logits.dtype == BF16
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < losses[0] - 0.3, losses


def test_column_copy_is_built_by_the_backward_and_refused_after_an_optimizer_step():
    """The MXFP8 column-wise weight copy (quantized backward) is quantized when the backward
    first needs it, not in the forward, then held with the row-wise copy; an optimizer step
    between a forward and a backward that has not made the copy yet is refused, naming the
    fix, instead of differentiating through weights the forward never used."""
    q = make_linear("mxfp8", "quantized")
    set_gemm(q, Gemm.TENSOR_CORE)
    x, dy = inputs()
    y = q(x.clone().requires_grad_(True))
    tw = q.qweight(Gemm.TENSOR_CORE)
    assert "col" not in tw.held  # the forward held the row-wise copy only
    y.backward(dy)
    held = tw.held["col"]
    assert_bytes_equal(held.qdata, quantize(q.weight.detach(), "mxfp8", axis=0).qdata, "col")
    q(x).backward(dy)
    assert tw.held["col"] is held  # built once per optimizer step
    opt = torch.optim.SGD(q.parameters(), lr=0.1)
    opt.step()  # new weights: the next forward quantizes them, row-wise only
    y = q(x.clone().requires_grad_(True))
    opt.step()  # the weights the forward used are gone before its backward made their copy
    with pytest.raises(RuntimeError, match=r"backward\(\) before optimizer.step\(\)"):
        y.backward(dy)


def spec_like(spec, shape):
    import dataclasses

    return dataclasses.replace(spec, shape=shape)


def test_an_optimizer_stepping_inside_the_backward_is_not_refused():
    """Per-parameter optimizers stepped in post-accumulate-grad hooks (the optimizer-in-backward
    pattern): the last layer's weight changes before the first layer's backward makes its
    column-wise copy; the first layer's own weight has not changed, so its copy is made, from
    the weights its forward used."""
    first, last = make_linear("mxfp8", "quantized", seed=1), make_linear("mxfp8", "quantized")
    last.weight = torch.nn.Parameter(last.weight.detach()[:, : first.out_features].contiguous())
    last.in_features = first.out_features
    last.spec = spec_like(last.spec, (last.out_features, first.out_features))
    for q in (first, last):
        set_gemm(q, Gemm.TENSOR_CORE)
        opt = torch.optim.SGD([q.weight], lr=0.1)
        q.weight.register_post_accumulate_grad_hook(lambda p, opt=opt: opt.step())
    torch.optim.SGD([first.weight], lr=0.1).step()  # after a step: no column copy held yet
    w_first = first.weight.detach().clone()
    x, _ = inputs()
    y = last(first(x))
    tw = first.qweight(Gemm.TENSOR_CORE)  # the forward's (the hooks' steps will replace it)
    assert "col" not in tw.held
    y.square().sum().backward()
    assert not torch.equal(first.weight.detach(), w_first)  # its own hook stepped it, after
    col = tw.held["col"]
    assert_bytes_equal(col.qdata, quantize(w_first, "mxfp8", axis=0).qdata, "first's copy")
