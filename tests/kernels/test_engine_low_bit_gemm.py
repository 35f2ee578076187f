"""The rollout engine's low-bit GEMM path (`mxrl.nn.paths.rollout.uses_low_bit_gemm`) under
Triton's interpreter: NVFP4 / MXFP8 weights held packed (no dequantized copy), the same greedy
tokens as the reference engine with logprobs within float rounding, and batch invariance.
The GPU tier (tests/engine/test_gpu.py) runs the same checks on CUDA."""

from __future__ import annotations

import pytest
import torch

from mxrl.engine import Engine, SamplingParams
from mxrl.formats import QTensor, quantize
from mxrl.kernels import Backend
from mxrl.nn.paths.rollout import (
    Grouping,
    RolloutExperts,
    RolloutLinear,
    uses_fp8_block_gemm,
    uses_low_bit_gemm,
)
from mxrl.nn.weight import QWeight
from tests.engine.test_engine import PROMPTS, tiny
from tests.kernels.test_decode_gemm import interpreter
from tests.nn.test_qmatmul import spec
from tests.numerics import assert_bytes_equal


def _greedy(n: int, tokens: int = 3) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_new_tokens=tokens) for _ in range(n)]


def held_packed(w) -> bool:
    """A received weight held as its codes and scales alone: a QWeight with no derived operand."""
    return isinstance(w, QWeight) and isinstance(w.q, QTensor) and not w.held


def packed_modules(engine: Engine) -> tuple[int, int]:
    """(dense projections held packed, expert blocks run grouped); asserts no packed weight
    also carries a dequantized copy."""
    dense = grouped = 0
    for module in engine.net.modules():
        if isinstance(module, RolloutLinear) and uses_low_bit_gemm(module.spec, engine.backend):
            assert module.packed and held_packed(module.w), module.spec.name
            dense += 1
        elif isinstance(module, RolloutExperts) and module.grouping is Grouping.LOW_BIT:
            assert all(held_packed(v) for v in module.values.values())
            grouped += 1
    return dense, grouped


@interpreter
@pytest.mark.parametrize(
    ("preset", "dense", "grouped"), [("mxfp8", 12, 3), ("nvfp4-dequantized", 0, 3)]
)
def test_packed_weights_and_same_tokens_as_reference(preset, dense, grouped):
    outs = {}
    for backend in ("reference", "triton"):
        engine = Engine(tiny(preset), preset, backend=backend, tile=8)
        if backend == "triton":
            assert packed_modules(engine) == (dense, grouped)
        else:
            assert packed_modules(engine) == (0, 0)
        outs[backend] = engine.generate(PROMPTS, _greedy(len(PROMPTS)))
    for ref, tri in zip(outs["reference"], outs["triton"], strict=True):
        assert tri.tokens == ref.tokens
        torch.testing.assert_close(tri.logprobs, ref.logprobs, rtol=0, atol=1e-5)
        assert_bytes_equal(tri.routed_experts, ref.routed_experts, "routing")


@interpreter
def test_batch_invariance_on_the_low_bit_path():
    engine = Engine(tiny("nvfp4-hp"), "nvfp4-hp", backend="triton", tile=8)
    assert packed_modules(engine)[1] > 0
    prompts = [PROMPTS[0], PROMPTS[3]]  # 18 tokens: three tiles mixing the two requests
    params = [SamplingParams(temperature=1.0, max_new_tokens=2, seed=5 + i) for i in range(2)]
    batch = engine.generate(prompts, params)
    for i, prompt in enumerate(prompts):
        alone = engine.generate([prompt], [params[i]])[0]
        assert alone.tokens == batch[i].tokens, f"request {i}"
        assert_bytes_equal(alone.logprobs, batch[i].logprobs, f"request {i} logprobs")


@interpreter
def test_block_fp8_experts_run_grouped_and_packed():
    """fp8-block routed experts: one grouped block-FP8 launch per projection on the triton
    backend (codes and scales held, no dequantized copy), the dense projections through the same
    kernel as one group; the same greedy tokens and routing as
    the reference engine's per-expert loop, logprobs within float rounding; batch invariant."""
    outs = {}
    for backend in ("reference", "triton"):
        engine = Engine(tiny("fp8-block"), "fp8-block", backend=backend, tile=8)
        experts = [m for m in engine.net.modules() if isinstance(m, RolloutExperts)]
        fp8 = [m for m in experts if m.specs["down"].format == "fp8_block"]
        assert len(fp8) == 3  # the last layer is bf16 (the preset's last 15%)
        assert all((m.grouping is Grouping.FP8_BLOCK) == (backend == "triton") for m in fp8)
        dense = [
            m for m in engine.net.modules()
            if isinstance(m, RolloutLinear) and m.spec.format == "fp8_block"
        ]  # fmt: skip
        assert len(dense) == 12  # q, k, v, o of the 3 fp8 layers
        if backend == "triton":
            assert all(held_packed(v) for m in fp8 for v in m.values.values())
            # the dense projections too: codes and scales held, no dequantized operand
            assert all(uses_fp8_block_gemm(m.spec, engine.backend) for m in dense)
            assert all(m.packed and held_packed(m.w) for m in dense)
        else:
            assert all(not m.packed and m.w is not None and m.w.held for m in dense)
        outs[backend] = engine.generate(PROMPTS, _greedy(len(PROMPTS)))
    for ref, tri in zip(outs["reference"], outs["triton"], strict=True):
        assert tri.tokens == ref.tokens
        torch.testing.assert_close(tri.logprobs, ref.logprobs, rtol=0, atol=1e-5)
        assert_bytes_equal(tri.routed_experts, ref.routed_experts, "routing")
    alone = engine.generate([PROMPTS[2]], _greedy(1))[0]
    assert alone.tokens == outs["triton"][2].tokens
    assert_bytes_equal(alone.logprobs, outs["triton"][2].logprobs, "alone")


LAUNCHES = [
    ("mxfp8", None, 1),
    ("nvfp4", "per_token", 1),
    ("nvfp4", "per_tensor", 3),
    ("fp8_block", None, 3),
]


@interpreter
@pytest.mark.parametrize(("fmt", "activations", "launches"), LAUNCHES)
def test_a_prefills_tiles_through_a_packed_weight_keep_each_tiles_bytes(
    fmt, activations, launches, monkeypatch
):
    """A packed projection over several tiles (a prefill): each row's bytes are those of its
    tile run alone, the last tile zero-padded. NVFP4 / MXFP8 with a row-wise activation
    quantization take one low-bit launch for all tiles, at the tile's configuration; NVFP4 with
    a per-tensor activation scale (one scale per tile) and block FP8 keep a launch per tile."""
    _packed_tiles(fmt, activations, launches, monkeypatch, "cpu", 8, 19)


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "activations", "launches"), LAUNCHES)
def test_on_cuda_a_prefills_packed_tiles_keep_each_tiles_bytes(
    fmt, activations, launches, monkeypatch
):
    """The same on CUDA at the engine's 128-row tile: 300 rows, three tiles (block FP8 through
    cuBLAS's blockwise `_scaled_mm` a tile at a time)."""
    _packed_tiles(fmt, activations, launches, monkeypatch, "cuda", 128, 300)


def _packed_tiles(fmt, activations, launches, monkeypatch, device, tile, rows):
    import mxrl.nn.paths.rollout as rollout

    extra = {"activations": activations} if activations else {}
    s = spec(fmt, shape=(256, 512), **extra)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    linear = RolloutLinear(s, dtype, Backend.TRITON, tile)
    assert linear.packed
    torch.manual_seed(0)
    block = {"block": (128, 128)} if fmt == "fp8_block" else {}
    linear.w = linear.materialize(quantize(torch.randn(256, 512, device=device), fmt, **block))["w"]
    x = torch.randn(rows, 512, device=device, dtype=dtype)
    alone = torch.cat([linear(x[i : i + tile]) for i in range(0, rows, tile)])
    calls = []
    if fmt != "fp8_block":
        gemm = rollout.low_bit_matmul
    else:
        gemm = rollout.fp8_block_matmul if device == "cuda" else rollout.grouped_fp8_block_matmul
    spy = lambda *a, **k: calls.append(1) or gemm(*a, **k)  # noqa: E731
    monkeypatch.setattr(rollout, gemm.__name__, spy)
    y = linear(x)
    assert len(calls) == launches
    assert y.shape == (rows, 256)
    assert_bytes_equal(y, alone, "rows")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [129, 300, 600])
def test_on_cuda_block_fp8_under_one_group_takes_one_call_with_the_tiles_bytes(rows, monkeypatch):
    """The engine's dense_gemm="grouped": a block-FP8 prefill through a packed weight in one
    cuBLAS blockwise call over all its (padded) rows instead of one a tile. Each row's bytes are
    those of its tile run alone (the tiles' path): the call is invariant in its row count."""
    import mxrl.nn.paths.rollout as rollout

    s = spec("fp8_block", shape=(256, 512))
    linear = RolloutLinear(s, torch.bfloat16, Backend.TRITON, 128)
    linear.path.one_group = True
    torch.manual_seed(0)
    w = quantize(torch.randn(256, 512, device="cuda"), "fp8_block", block=(128, 128))
    linear.w = linear.materialize(w)["w"]
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    alone = torch.cat([linear(x[i : i + 128]) for i in range(0, rows, 128)])
    calls = []
    gemm = rollout.fp8_block_matmul
    monkeypatch.setattr(
        rollout, "fp8_block_matmul", lambda *a, **k: calls.append(1) or gemm(*a, **k)
    )
    y = linear(x)
    assert len(calls) == 1
    assert_bytes_equal(y, alone, "rows")
