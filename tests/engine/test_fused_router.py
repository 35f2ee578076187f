"""The router's fused softmax top-k in the engine (mxrl.engine.modules.RolloutTopK) under Triton's
interpreter: the triton backend swaps the model's TopKSoftmax for it (the reference backend and
routers wider than one program keep the model's module), with the reference engine's tokens and
routing, and a request's bytes alone and in a batch."""

from __future__ import annotations

import torch

from mxrl.engine import Engine, SamplingParams
from mxrl.engine.modules import RolloutTopK
from mxrl.models.layers import TopKSoftmax
from tests.engine.test_engine import PROMPTS, tiny
from tests.kernels.test_decode_gemm import interpreter
from tests.numerics import assert_bytes_equal


def _routers(engine: Engine) -> list[TopKSoftmax]:
    return [m for m in engine.net.modules() if isinstance(m, TopKSoftmax)]


@interpreter
def test_triton_engine_routes_through_the_fused_kernel():
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=3) for _ in PROMPTS]
    outs = {}
    for backend in ("reference", "triton"):
        engine = Engine(tiny("bf16"), "bf16", backend=backend, tile=8)
        routers = _routers(engine)
        assert len(routers) == 4  # one per MoE layer of the tiny model
        assert all(isinstance(m, RolloutTopK) == (backend == "triton") for m in routers)
        outs[backend] = engine.generate(PROMPTS, greedy)
    for ref, tri in zip(outs["reference"], outs["triton"], strict=True):
        assert tri.tokens == ref.tokens
        torch.testing.assert_close(tri.logprobs, ref.logprobs, rtol=0, atol=1e-5)
        assert_bytes_equal(tri.routed_experts, ref.routed_experts, "routing")
    sampled = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=11 + i) for i in range(2)]
    batch = engine.generate([PROMPTS[0], PROMPTS[3]], sampled)
    alone = engine.generate([PROMPTS[3]], sampled[1:])[0]
    assert alone.tokens == batch[1].tokens
    assert_bytes_equal(alone.routed_experts, batch[1].routed_experts, "routing alone")
    assert_bytes_equal(alone.logprobs, batch[1].logprobs, "logprobs alone")


@interpreter
def test_a_router_wider_than_one_program_keeps_the_models_module(monkeypatch):
    monkeypatch.setattr("mxrl.engine.engine.MAX_ROUTE_EXPERTS", 4)  # the tiny model has 8
    engine = Engine(tiny("bf16"), "bf16", backend="triton", tile=8)
    assert not any(isinstance(m, RolloutTopK) for m in _routers(engine))
