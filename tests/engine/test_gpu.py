"""The engine on a CUDA device: batch invariance under every preset (fixed-shape tiles make the
cuBLAS kernels the same for every batch), and the bytes it holds equal the CPU export. GPU tier."""

from __future__ import annotations

import pytest

from mxrl.engine import Engine, SamplingParams, export_weights
from tests.engine.test_engine import PRESETS, PROMPTS, tiny
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", PRESETS)
def test_batch_invariance_on_cuda(preset):
    engine = Engine(tiny(preset), preset, device="cuda", tile=8)
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=12, seed=100 + i)
        for i in range(len(PROMPTS))
    ]
    batch = engine.generate(PROMPTS, params)
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], [params[i]])[0]
        assert alone.tokens == batch[i].tokens, f"request {i}"
        assert_bytes_equal(alone.logprobs, batch[i].logprobs, f"request {i} logprobs")
        assert_bytes_equal(alone.routed_experts, batch[i].routed_experts, f"request {i} routing")


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4-dequantized"])
def test_cuda_engine_holds_the_cpu_bytes(preset):
    model = tiny(preset)
    engine = Engine(model.cuda(), preset)  # exports from the CUDA master weights
    cpu = {r.name: r.hash for r in export_weights(model.cpu().named_parameters(), engine.plan)}
    for record in engine.records():
        assert record.hash == cpu[record.name], record.name


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4-dequantized"])
def test_engine_triton_backend_equals_reference(preset):
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=8, seed=7 + i) for i in range(len(PROMPTS))
    ]
    outs = {}
    for backend in ("reference", "triton"):
        engine = Engine(tiny(preset), preset, device="cuda", backend=backend)
        assert engine.backend == backend
        outs[backend] = engine.generate(PROMPTS, params)
    for ref, tri in zip(outs["reference"], outs["triton"], strict=True):
        assert ref.tokens == tri.tokens
        assert_bytes_equal(tri.logprobs, ref.logprobs, "logprobs")
