"""deepseek_v3 in the engine on the Triton paged attention, under Triton's interpreter: MLA's
cache holds keys of qk_nope + qk_rope = 24 values (not a power of two: padded inside the kernel)
and values of 16, so the triton backend attends with the kernel (the reference engine with
the reference attention: tests/engine/test_deepseek_engine.py); the trainer's logprobs to
1e-5 and a request's bytes alone and in a batch."""

from __future__ import annotations

import pytest
import torch

from mxrl.app.probe import measure_mismatch
from mxrl.engine import Engine, SamplingParams
from tests.engine.test_deepseek_engine import PROMPTS, _prompts, _trainer
from tests.kernels.test_decode_gemm import interpreter
from tests.models.deepseek_reference import CONFIGS
from tests.numerics import assert_bytes_equal, assert_same_outputs

# the tiny config with values as wide as the kernel's smallest tile (its v_head_dim is 12)
CONFIG = {**CONFIGS["qlora-grouped-shared1"], "v_head_dim": 16}


@interpreter
def test_mla_attends_with_the_kernel_as_the_trainer_does():
    trainer = _trainer(CONFIG)
    engine = Engine(trainer, "bf16", backend="triton", weight_dtype=torch.float32, tile=8)
    assert engine._attention_kernel
    assert CONFIG["qk_nope_head_dim"] + CONFIG["qk_rope_head_dim"] == 24
    params = SamplingParams(max_new_tokens=6, seed=0)
    m = measure_mismatch(trainer, engine, _prompts(4), params)
    assert m.num_tokens == 4 * 6
    assert m.logp_abs_diff_max < 1e-5 and m.k3 < 1e-10, m
    sampled = [SamplingParams(temperature=1.0, max_new_tokens=5, seed=30 + i) for i in range(3)]
    batch = engine.generate(PROMPTS[:3], sampled)
    alone = engine.generate([PROMPTS[2]], sampled[2:])[0]
    assert alone.tokens == batch[2].tokens
    assert_bytes_equal(alone.logprobs, batch[2].logprobs, "logprobs alone")
    assert_bytes_equal(alone.routed_experts, batch[2].routed_experts, "routing alone")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["bf16", "mxfp8", "nvfp4-dequantized"])
def test_mla_graph_decode_gives_the_eager_bytes(preset):
    """MLA's decode captured in CUDA graphs (bucketed, padded), one step at a time and
    overlapped, against the eager step in bf16: the same tokens, logprobs and routing, byte for
    byte, for a batch whose size crosses graph buckets as requests finish."""
    prompts = [_prompts(11, seed=3)[i] + [i + 1] for i in range(11)]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=4 + 3 * (i % 5), seed=50 + i)
        for i in range(len(prompts))
    ]
    outs = {}
    for graphs, overlap in ((False, False), (True, False), (True, True)):
        engine = Engine(
            _trainer(CONFIG), preset, device="cuda", compute_dtype=torch.bfloat16,
            cuda_graphs=graphs, overlap=overlap,
        )  # fmt: skip
        assert engine._attention_kernel
        outs[graphs, overlap] = engine.generate(prompts, params)
        assert (engine.runner.num_graph_steps > 0) == graphs
    for key in ((True, False), (True, True)):
        assert_same_outputs(outs[False, False], outs[key], str(key))
