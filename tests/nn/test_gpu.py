"""The quantized ops on a CUDA device: same quantized bytes as on the CPU, the same forward up to
GEMM summation order, and training runs. GPU tier (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mxrl.arch import builtin_config
from mxrl.kernels import Gemm
from mxrl.models import build_model
from mxrl.nn import QExperts, apply_plan, set_gemm
from mxrl.nn.operands import Form
from mxrl.recipe import Backward, resolve
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4-dequantized"])
def test_tiny_moe_on_cuda_matches_cpu(preset):
    cpu = build_model(builtin_config("tiny-moe"), seed=0)
    gpu = build_model(builtin_config("tiny-moe"), seed=0, device="cuda")
    for m in (cpu, gpu):
        apply_plan(m, resolve(preset, {n: p.shape for n, p in m.named_parameters()}))
    set_gemm(gpu, "reference")  # the fp32 reference GEMMs on both (fast paths: test_fast_gpu)
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(gpu(ids.cuda()).cpu(), cpu(ids), rtol=1e-4, atol=1e-4)
    qc = cpu.model.layers[0].mlp.experts
    qg = gpu.model.layers[0].mlp.experts
    assert isinstance(qc, QExperts) and isinstance(qg, QExperts)
    lp_g, lp_c = (
        q.qweight("gate_up", Gemm.REFERENCE).operand(Form.LP, torch.float32) for q in (qg, qc)
    )
    assert_bytes_equal(lp_g.cpu(), lp_c, "lp")


def test_training_steps_on_cuda():
    model = build_model(builtin_config("tiny-moe"), seed=1, device="cuda")
    apply_plan(model, resolve("mxfp8", {n: p.shape for n, p in model.named_parameters()}))
    ids = torch.randint(1, 64, (4, 24), generator=torch.Generator().manual_seed(2)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize(
    "preset", ["mxfp8", "nvfp4-dequantized", "fp8-block", "fp8-block-quantized"]
)
def test_triton_backend_equals_reference_backend_bitwise(preset):
    """The backend only changes who quantizes, not the bytes: logits and every gradient of the
    tiny MoE are bit-identical with the Triton kernels and with the reference on CUDA. The mxfp8
    and fp8-block-quantized presets run the quantized backward (dy and x quantized on the
    backend; experts see token counts that are not whole blocks, so the column-wise copies are
    padded)."""
    wide = (
        {
            "hidden_size": 128,
            "head_dim": 32,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
        }
        if preset.startswith("fp8-block")
        else {}
    )
    cfg = {**builtin_config("tiny-moe"), **wide}
    ids = torch.randint(1, 64, (3, 33), generator=torch.Generator().manual_seed(0)).cuda()
    grads = {}
    for backend in ("reference", "triton"):
        model = build_model(cfg, seed=0, device="cuda")
        plan = resolve(preset, {n: p.shape for n, p in model.named_parameters()})
        quantized = preset in ("mxfp8", "fp8-block-quantized")
        assert (plan.backward is Backward.QUANTIZED) == quantized, plan.backward
        apply_plan(model, plan, backend=backend)
        logits = model(ids[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        grads[backend] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    ref_logits, ref_grads = grads["reference"]
    tri_logits, tri_grads = grads["triton"]
    assert_bytes_equal(tri_logits, ref_logits, "logits")
    for name, g in ref_grads.items():
        assert_bytes_equal(tri_grads[name], g, name)
