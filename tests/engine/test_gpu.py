"""The engine on a CUDA device: batch invariance under every preset (fixed-shape tiles make the
cuBLAS kernels the same for every batch; the low-bit GEMMs run one fixed configuration per
weight), the bytes it holds equal the CPU export, and the triton engine (packed low-bit GEMMs)
matches the reference engine. GPU tier."""

from __future__ import annotations

import pytest
import torch

from mxrl.engine import CacheOptions, Engine, SamplingParams
from mxrl.nn.paths.rollout import Grouping, RolloutExperts
from mxrl.weights import export_weights
from tests.engine.test_engine import PRESETS, PROMPTS, tiny
from tests.numerics import assert_bytes_equal, assert_same_outputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", PRESETS)
def test_batch_invariance_on_cuda(preset, compute_dtype):
    """fp32: the reference's dtype; bf16: what a GPU user runs (bf16 experts then take
    torch._grouped_mm, the KV cache and the Triton attention run in bf16)."""
    engine = Engine(tiny(preset), preset, device="cuda", tile=8, compute_dtype=compute_dtype)
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=12, seed=100 + i)
        for i in range(len(PROMPTS))
    ]
    batch = engine.generate(PROMPTS, params)
    if compute_dtype is torch.bfloat16 and preset == "bf16":
        assert all(m.grouping is Grouping.BF16 for m in _experts(engine))
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], [params[i]])[0]
        assert alone.tokens == batch[i].tokens, f"request {i}"
        assert_bytes_equal(alone.logprobs, batch[i].logprobs, f"request {i} logprobs")
        assert_bytes_equal(alone.routed_experts, batch[i].routed_experts, f"request {i} routing")


def _experts(engine):
    return [m for m in engine.net.modules() if isinstance(m, RolloutExperts)]


def test_chunked_prefill_and_prefix_sharing_on_cuda():
    """The Triton attention and the scheduler on the GPU: a GRPO group and a 5-token step
    budget give the bytes each request gets alone."""
    from mxrl.engine import CacheOptions

    prompts = [PROMPTS[3] * 4] * 3 + [PROMPTS[0]]
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=7 + i) for i in range(4)]
    for cache in (None, CacheOptions(max_num_batched_tokens=5)):
        engine = Engine(tiny("nvfp4-hp"), "nvfp4-hp", device="cuda", cache=cache)
        assert engine._attention_kernel
        alone = [engine.generate([p], [q])[0] for p, q in zip(prompts, params, strict=True)]
        engine._blocks = None
        batch = engine.generate(prompts, params)
        for i, (a, b) in enumerate(zip(alone, batch, strict=True)):
            assert a.tokens == b.tokens, f"request {i}"
            assert_bytes_equal(a.logprobs, b.logprobs, f"request {i} logprobs")
            assert_bytes_equal(a.routed_experts, b.routed_experts, f"request {i} routing")


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4-dequantized"])
def test_cuda_engine_holds_the_cpu_bytes(preset):
    model = tiny(preset)
    engine = Engine(model.cuda(), preset)  # exports from the CUDA master weights
    cpu = {r.name: r.hash for r in export_weights(model.cpu().named_parameters(), engine.plan)}
    for record in engine.records():
        assert record.hash == cpu[record.name], record.name


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4-hp", "nvfp4-dequantized"])
def test_engine_triton_backend_matches_reference(preset):
    """The triton engine runs NVFP4 / MXFP8 projections through the packed low-bit GEMMs (a
    different fp32 summation order from the reference's dequantized matmul): same greedy
    tokens and routing, logprobs within float rounding."""
    from tests.kernels.test_engine_low_bit_gemm import packed_modules

    params = [SamplingParams(temperature=0.0, max_new_tokens=8) for _ in PROMPTS]
    outs = {}
    for backend in ("reference", "triton"):
        engine = Engine(tiny(preset), preset, device="cuda", backend=backend)
        assert engine.backend == backend
        assert (packed_modules(engine)[1] > 0) == (backend == "triton")
        outs[backend] = engine.generate(PROMPTS, params)
    for ref, tri in zip(outs["reference"], outs["triton"], strict=True):
        assert ref.tokens == tri.tokens
        torch.testing.assert_close(tri.logprobs, ref.logprobs, rtol=0, atol=1e-4)
        assert_bytes_equal(tri.routed_experts, ref.routed_experts, "routing")


def _mixed_params(n):
    """Requests that finish at different steps and sample differently (the decode batch
    shrinks, graph buckets change, padding rows come and go)."""
    kinds = [
        dict(temperature=1.0),
        dict(temperature=0.0),
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.0, top_p=0.8),
    ]
    return [
        SamplingParams(max_new_tokens=4 + 3 * (i % 5), seed=50 + i, **kinds[i % len(kinds)])
        for i in range(n)
    ]


@pytest.mark.parametrize("preset", PRESETS)
def test_graph_decode_gives_the_eager_bytes(preset):
    """CUDA-graph decode (bucketed, padded), one step at a time and overlapped (each decode
    step queued before the one before it is read), against the eager step, in bf16 as users run
    it: the same tokens, logprobs and routing, byte for byte; a request alone gives them too."""
    prompts = [PROMPTS[i % len(PROMPTS)] + [i + 1] for i in range(11)]
    params = _mixed_params(len(prompts))
    outs = {}
    # eager one step at a time; graphs one step at a time; graphs overlapped (the default)
    for graphs, overlap in ((False, False), (True, False), (True, True)):
        engine = Engine(
            tiny(preset), preset, device="cuda", compute_dtype=torch.bfloat16,
            cuda_graphs=graphs, overlap=overlap,
        )  # fmt: skip
        outs[graphs, overlap] = engine.generate(prompts, params)
        # graphs need grouped experts: every preset's in bf16 compute (block FP8 included)
        assert (engine.runner.num_graph_steps > 0) == graphs
        assert (engine.stats.ahead_steps > 0) == overlap
    alone = engine.generate([prompts[9]], [params[9]])[0]
    for key in ((True, False), (True, True)):
        assert_same_outputs(outs[False, False], outs[key], str(key))
    assert alone.tokens == outs[True, True][9].tokens
    assert_bytes_equal(alone.logprobs, outs[True, True][9].logprobs, "alone logprobs")


def test_overlapped_graph_decode_drops_the_rows_after_a_stop():
    """A stop token in a graph decode queued ahead: the stopped request's row of the next step
    is dropped, and every request gets the bytes of one step at a time."""
    prompts = [PROMPTS[i % len(PROMPTS)] + [i + 1] for i in range(6)]

    def make(overlap):
        return Engine(
            tiny("bf16"), "bf16", device="cuda", compute_dtype=torch.bfloat16, overlap=overlap
        )

    def params(stop=()):
        return [
            SamplingParams(temperature=1.0, max_new_tokens=24, seed=80 + i, stop_token_ids=stop)
            for i in range(len(prompts))
        ]

    free = make(False).generate(prompts, params())[0].tokens
    # a token request 0 first samples in a decode step past the second: stopped there, it
    # leaves a row in the step queued ahead
    stop = free[next(k for k in range(2, len(free)) if free[k] not in free[:k])]
    want = make(False).generate(prompts, params((stop,)))
    engine = make(True)
    got = engine.generate(prompts, params((stop,)))
    assert engine.runner.num_graph_steps > 0 and engine.stats.ahead_rows_dropped > 0
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert w.tokens == g.tokens and w.finish_reason == g.finish_reason, f"request {i}"
        assert_bytes_equal(w.logprobs, g.logprobs, f"request {i} logprobs")
        assert_bytes_equal(w.routed_experts, g.routed_experts, f"request {i} routing")


def test_graphs_follow_a_weight_load():
    """After load_weights the graphs decode with the new weights (in place, or recaptured):
    the same bytes as a fresh engine built on the new weights."""
    preset, kw = "nvfp4-dequantized", dict(device="cuda", compute_dtype=torch.bfloat16)
    params = _mixed_params(5)
    engine = Engine(tiny(preset, seed=0), preset, **kw)
    engine.generate(PROMPTS, params[:4])
    new = tiny(preset, seed=1)
    engine.load_weights(export_weights(new.named_parameters(), engine.plan), engine.plan.hash())
    got = engine.generate(PROMPTS, params[:4])
    want = Engine(new, preset, **kw).generate(PROMPTS, params[:4])
    assert engine.runner.num_graph_steps > 0
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens
        assert_bytes_equal(g.logprobs, w.logprobs, "logprobs after a load")


def test_graphs_captured_up_front_give_the_lazily_captured_bytes():
    """capture_graphs captures every bucket before generate; generate then captures nothing
    (its batch shrinks through several sizes as requests stop) and gives the bytes of an
    engine that captured each size at its first step."""
    from mxrl.engine.graph import DecodeGraphs

    preset, kw = "bf16", dict(device="cuda", compute_dtype=torch.bfloat16)
    lengths = [3, 9, 5, 14, 7]
    params = [SamplingParams(temperature=1.0, max_new_tokens=n, seed=70 + i)
              for i, n in enumerate(lengths)]  # fmt: skip
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(5)]
    want = Engine(tiny(preset), preset, **kw).generate(prompts, params)
    engine = Engine(tiny(preset), preset, cache=CacheOptions(max_num_seqs=8), **kw)
    held = engine.capture_graphs(64)
    assert held == len(engine._graphs.sizes) == len(engine._graphs.graphs)
    captured = []
    original = DecodeGraphs._capture

    def counting(self, p):
        captured.append(p)
        return original(self, p)

    DecodeGraphs._capture = counting
    try:
        got = engine.generate(prompts, params)
    finally:
        DecodeGraphs._capture = original
    assert captured == [] and engine.runner.num_graph_steps > 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.tokens == w.tokens, f"request {i}"
        assert_bytes_equal(g.logprobs, w.logprobs, f"request {i} logprobs")
        assert_bytes_equal(g.routed_experts, w.routed_experts, f"request {i} routing")


def test_sampler_rows_do_not_depend_on_the_batch_on_cuda():
    from mxrl.engine.sampler import SamplingBatch, sample_batch

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 151936, generator=g) * 4).cuda()
    params = _mixed_params(64)
    seeds, counters = list(range(64)), [3 * i for i in range(64)]
    dev = torch.device("cuda")
    tokens, lps = sample_batch(logits, SamplingBatch.build(params, seeds, counters, dev))
    for lo, hi in ((0, 1), (5, 6), (3, 20), (40, 64)):
        b = SamplingBatch.build(params[lo:hi], seeds[lo:hi], counters[lo:hi], dev)
        t, lp = sample_batch(logits[lo:hi], b)
        assert torch.equal(t, tokens[lo:hi]), (lo, hi)
        assert_bytes_equal(lp, lps[lo:hi], f"rows {lo}:{hi}")
    cpu_b = SamplingBatch.build(params[:4], seeds[:4], counters[:4], torch.device("cpu"))
    t_cpu, _ = sample_batch(logits[:4].cpu(), cpu_b)  # the noise's bits are the same on the CPU
    assert torch.equal(t_cpu, tokens[:4].cpu())


def test_fused_sampler_rows_do_not_depend_on_the_batch_on_cuda():
    """The one-launch sampler (the engine's default on CUDA for rows without top-k / top-p):
    a row's token and logprob alone equal its bytes in the batch, and the tokens are the torch
    sampler's (the same noise integers; exp/log rounding could only split exact near-ties)."""
    from mxrl.engine.sampler import SamplingBatch, sample_batch

    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(64, 151936, generator=g) * 4).cuda()
    params = [SamplingParams(temperature=[1.0, 0.0, 0.7][i % 3], seed=i) for i in range(64)]
    seeds, counters = list(range(64)), [7 * i for i in range(64)]
    dev = torch.device("cuda")
    b = SamplingBatch.build(params, seeds, counters, dev)
    tokens, lps = sample_batch(logits, b, fused=True)
    ref_tokens, ref_lps = sample_batch(logits, b)
    assert (tokens == ref_tokens).float().mean() > 0.95
    torch.testing.assert_close(
        lps[tokens == ref_tokens], ref_lps[tokens == ref_tokens], rtol=0, atol=1e-5
    )
    for lo, hi in ((0, 1), (5, 6), (3, 20), (40, 64)):
        sub = SamplingBatch.build(params[lo:hi], seeds[lo:hi], counters[lo:hi], dev)
        t, lp = sample_batch(logits[lo:hi], sub, fused=True)
        assert torch.equal(t, tokens[lo:hi]), (lo, hi)
        assert_bytes_equal(lp, lps[lo:hi], f"rows {lo}:{hi}")


@pytest.mark.parametrize("fused", [False, True])
def test_a_cuda_step_without_sampling_rows_samples_nothing_on_cuda(fused):
    """A step where no sequence samples (chunked prefill): empty tokens and logprobs on the
    logits' device, as the engine's step concatenates and copies them with the CUDA results."""
    from mxrl.engine.sampler import SamplingBatch, sample_batch

    dev = torch.device("cuda")
    tokens, lps = sample_batch(
        torch.zeros(0, 151936, device=dev), SamplingBatch.build([], [], [], dev), fused=fused
    )
    assert tokens.device.type == "cuda" and lps.device.type == "cuda"
    assert tokens.shape == (0,) and tokens.dtype == torch.int64
    assert lps.shape == (0,) and lps.dtype == torch.float32


@pytest.mark.parametrize("vocab", [32, 64, 4096, 1 << 17])
def test_top_p_breaks_ties_by_vocabulary_index_on_cuda(vocab):
    """filter_logits' docstring: ties in the sort are broken by vocabulary index (stable). CUDA's
    unstable sort (bitonic for short rows, others for longer ones) may put any of the tied tokens
    first. V equal logits, V a power of two: each probability is exactly 1/V and the mass before
    the i-th of the sort exactly i/V, so p = 1/2 and 1/4 keep the first V/2 and V/4 tokens."""
    from mxrl.engine.sampler import filter_logits

    logits = torch.zeros(2, vocab, device="cuda")
    got = filter_logits(logits, top_p_N=torch.tensor([0.5, 0.25], device="cuda")).cpu()
    assert torch.isfinite(got[0]).nonzero()[:, 0].tolist() == list(range(vocab // 2))
    assert torch.isfinite(got[1]).nonzero()[:, 0].tolist() == list(range(vocab // 4))
