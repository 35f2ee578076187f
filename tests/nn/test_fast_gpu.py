"""The tensor-core training GEMMs on the H200 (GPU tier, `pytest -m gpu`; docs/nn.md "Fast paths"):

- each grouped expert projection (torch._grouped_mm, CUTLASS) and its dgrad and wgrad against the
  reference loop (fp32 cuBLAS GEMMs, TF32 off) on the same inputs, within the stated bound, on
  the reference and the triton quantizers, at a small and a Qwen3-30B-A3B-wide shape;
- dense quantized ops: forward within the fp32 summation-order bound of the reference, block FP8
  through torch._scaled_mm within its bound (tests/kernels/test_fp8_gemm.py);
- a decoder layer's forward and backward under bf16 autocast make no host sync (the expert
  loop's did); the tiny model trains under every preset; activation checkpointing gives the same
  gradients.
"""

from __future__ import annotations

import pytest
import torch

from mxrl.arch import builtin_config
from mxrl.kernels import Gemm
from mxrl.models import build_model
from mxrl.models.layers import LayerInputs
from mxrl.nn import apply_plan, set_gemm
from mxrl.recipe import resolve
from tests.nn.test_fast import CASES, FP8_MMA, assert_within, check_grouped_projection
from tests.nn.test_qmatmul import inputs, make_linear

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
WIDE = {  # fp8_block needs multiples of 128
    "hidden_size": 128,
    "head_dim": 32,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}


@pytest.fixture(autouse=True, scope="module")
def _no_tf32():
    assert not torch.backends.cuda.matmul.allow_tf32  # the reference is a true fp32 GEMM
    yield


@pytest.mark.parametrize(("fmt", "mode"), CASES)
@pytest.mark.parametrize("which", ["gate_up", "down"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_grouped_projection_on_cuda_within_the_bound(fmt, mode, which, backend):
    check_grouped_projection(fmt, mode, which, device="cuda", backend=backend)


@pytest.mark.parametrize(("fmt", "mode"), [("bf16", "high_precision"), *CASES[1:]])
def test_grouped_projection_at_qwen3_width(fmt, mode):
    """16 experts of Qwen3-30B-A3B's width (H 2048, I 768), 600 (token, slot) rows."""
    check_grouped_projection(fmt, mode, "down", "cuda", "triton", size=(16, 2048, 768, 300))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_dense_forward_on_tensor_cores_within_the_order_bound(fmt):
    q = make_linear(fmt).cuda()
    x, _ = inputs()
    x = x.cuda()
    set_gemm(q, Gemm.REFERENCE)
    y_ref = q(x).detach()
    set_gemm(q, Gemm.TENSOR_CORE)
    y = q(x).detach()
    absprod = x.abs() @ q.weight.detach().abs().t()
    assert_within(y, y_ref, absprod, x.shape[1], 2.0**-8 if fmt == "nvfp4" else 0.0, "forward")


def test_dense_fp8_block_forward_on_scaled_mm():
    q = make_linear("fp8_block").cuda()
    x = torch.randn(300, q.in_features, device="cuda")
    set_gemm(q, Gemm.REFERENCE)
    y_ref = q(x).detach()
    set_gemm(q, Gemm.TENSOR_CORE)
    y = q(x).detach()
    assert (y - y_ref).abs().max() <= 2e-3 * y_ref.abs().max()  # Hopper FP8 accumulation


@pytest.mark.parametrize("which", ["gate_up", "down"])
@pytest.mark.parametrize("size", [(4, 128, 128, 45), (16, 2048, 768, 300)], ids=["small", "qwen"])
def test_grouped_block_fp8_quantized_backward_on_fp8_tensor_cores(which, size):
    """fp8-block's experts end to end on FP8 codes: the forward kernel, its dgrad reading w
    transposed, the token-grouped wgrad (FP8 MMAs), against the reference loop."""
    check_grouped_projection("fp8_block", "quantized", which, "cuda", "triton", size=size)


@pytest.mark.parametrize("rows", [50, 300])
def test_dense_fp8_block_quantized_backward_on_scaled_mm(rows):
    """dgrad (1x128 x 128x128, the forward's codes transposed) and wgrad (1x128 x 1x128 along
    the tokens) on torch._scaled_mm, against the reference's fp32 GEMMs of the same bytes."""
    from tests.nn.test_fp8_block_backward import N, _inputs, _linear

    q = _linear().cuda()
    tw = q.qweight(Gemm.TENSOR_CORE)
    assert tw.col() is not None and tw.col().qdata.data_ptr() != tw.q.qdata.data_ptr()
    assert torch.equal(tw.col().qdata, tw.q.qdata.t())
    x, dy = (t.cuda() for t in _inputs(rows))
    dy = dy.to(BF16).float()
    grads = {}
    for gemm in (Gemm.REFERENCE, Gemm.TENSOR_CORE):
        set_gemm(q, gemm)
        q.weight.grad = None
        xg = x.clone().requires_grad_(True)
        q(xg).backward(dy)
        grads[gemm] = (xg.grad, q.weight.grad)
    (dx_ref, dw_ref), (dx, dw) = grads[Gemm.REFERENCE], grads[Gemm.TENSOR_CORE]
    w = q.weight.detach()
    assert_within(dx, dx_ref, 2 * dy.abs() @ w.abs(), N, FP8_MMA, "dx")
    assert_within(dw, dw_ref, 2 * dy.abs().t() @ x.abs(), rows, FP8_MMA, "dw")


def _model(preset, cfg=None, seed=0):
    model = build_model(cfg or builtin_config("tiny-moe"), seed=seed, device="cuda")
    apply_plan(model, resolve(preset, {n: p.shape for n, p in model.named_parameters()}))
    model.set_training_options(compute_dtype=BF16)
    return model.train()


def _step(model, ids):
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss


PRESETS = ["bf16", "mxfp8", "mxfp8-hp", "mxfp8-dequantized", "nvfp4-hp", "nvfp4-dequantized"]


@pytest.mark.parametrize("preset", [*PRESETS, "fp8-block", "fp8-block-quantized"])
def test_a_decoder_layer_step_makes_no_host_sync(preset):
    """Forward and backward of a MoE decoder layer (attention, router, grouped experts) under
    CUDA's sync debug mode "error". (The embedding's backward and the loss are torch's.)"""
    cfg = {**builtin_config("tiny-moe"), **WIDE} if preset.startswith("fp8-block") else None
    model = _model(preset, cfg)
    assert set_gemm(model, None) > 0  # the device default: tensor cores
    layer = model.model.layers[0]
    assert layer.is_moe
    h = torch.randn(3, 40, model.config.hidden_size, device="cuda", requires_grad=True)
    rope = model.model.rotary_emb(torch.arange(40, device="cuda")[None].expand(3, 40), h.dtype)

    def step():
        with torch.autocast("cuda", dtype=BF16):
            out, _ = layer(h, LayerInputs(rope))
        out.float().square().mean().backward()

    step()  # the first step compiles the kernels and quantizes the weights (once per optimizer step)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("preset", PRESETS)
def test_checkpointing_changes_no_gradient(preset):
    """Recomputed layers quantize the same bytes: the same gradients up to the attention
    backward's own run-to-run accumulation order."""
    ids = torch.randint(1, 64, (3, 40), generator=torch.Generator().manual_seed(1)).cuda()
    grads = []
    for checkpoint in (False, True):
        model = _model(preset)
        model.set_training_options(compute_dtype=BF16, checkpoint_layers=checkpoint)
        _step(model, ids)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert (grads[1][name] - g).abs().max() <= 1e-2 * g.abs().max(), name


@pytest.mark.parametrize("preset", [*PRESETS, "fp8-block", "fp8-block-quantized"])
def test_tiny_model_trains_with_bf16_compute(preset):
    cfg = {**builtin_config("tiny-moe"), **WIDE} if preset.startswith("fp8-block") else None
    model = _model(preset, cfg, seed=1)
    ids = torch.randint(1, 64, (4, 24), generator=torch.Generator().manual_seed(2)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        losses.append(_step(model, ids).item())
        opt.step()
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("preset", ["bf16", "mxfp8", "nvfp4-dequantized"])
def test_tensor_core_logits_near_the_reference(preset):
    """The whole model, fp32 reference vs bf16 tensor-core step: bf16 activations (and, where
    a bf16 activation is quantized again, a neighbouring code) keep them near, not equal."""
    ids = torch.randint(1, 64, (3, 33), generator=torch.Generator().manual_seed(0)).cuda()
    out = {}
    for gemm, compute in (("reference", None), ("tensor_core", BF16)):
        model = _model(preset)
        set_gemm(model, gemm)
        model.set_training_options(compute_dtype=compute)
        out[gemm] = model(ids[:, :-1]).float()
    ref, fast = out["reference"], out["tensor_core"]
    assert (fast - ref).abs().max() <= 0.1 * ref.abs().max()
