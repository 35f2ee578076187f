"""The rollout engine on the tiny MoE: batch invariance under every preset, sampling, weights
held per the plan, verified loads that keep the previous weights on any failure."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mxrl.arch import builtin_config
from mxrl.engine import Engine, SamplingParams
from mxrl.engine.sampler import processed_logprobs
from mxrl.formats import QTensor
from mxrl.models import build_model
from mxrl.recipe import resolve
from mxrl.weights import WeightRecord, export_weights
from tests.engine import sampling_spec as spec
from tests.numeric_env import in_capability_matrix
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

PRESETS = [
    "bf16",
    "mxfp8",
    "mxfp8-hp",
    "mxfp8-dequantized",
    "nvfp4-hp",
    "nvfp4-dequantized",
    "fp8-block",
]
WIDE = {
    "hidden_size": 128,
    "head_dim": 32,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}
PROMPTS = [[5, 9, 2, 7, 1, 33, 12], [3, 4], [60, 61, 62, 63, 1], [8] * 11]
# One preset per engine the presets give: an -hp or -dequantized preset differs from its kind's
# only in the backward, which the engine never reads (the same plan, spec for spec:
# test_the_engine_kinds_cover_every_preset). The capability matrix runs these; the main run and
# the GPU tier every preset.
ENGINE_KINDS = ["bf16", "mxfp8", "nvfp4-dequantized", "fp8-block"]


def tiny(preset="bf16", seed=0, **overrides):
    cfg = {**builtin_config("tiny-moe"), **(WIDE if preset == "fp8-block" else {}), **overrides}
    return build_model(cfg, seed=seed)


def _params(seed, **kw):
    return SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed, **kw)


def test_the_engine_kinds_cover_every_preset():
    def specs(preset):
        model = tiny(preset)
        return list(resolve(preset, {n: p.shape for n, p in model.named_parameters()}).values())

    kinds = [specs(kind) for kind in ENGINE_KINDS]
    for preset in PRESETS:
        assert specs(preset) in kinds, preset


@pytest.mark.parametrize("preset", ENGINE_KINDS if in_capability_matrix() else PRESETS)
def test_batch_invariance(preset):
    """A request's tokens, logprobs and routed experts are identical alone and in a batch with
    requests of other lengths (tile 8 < the batch's tokens, so tiles mix requests)."""
    engine = Engine(tiny(preset), preset, tile=8)
    params = [_params(100 + i) for i in range(len(PROMPTS))]
    batch = engine.generate(PROMPTS, params)
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], [params[i]])[0]
        assert alone.tokens == batch[i].tokens, f"request {i}"
        assert_bytes_equal(alone.logprobs, batch[i].logprobs, f"request {i} logprobs")
        assert_bytes_equal(alone.routed_experts, batch[i].routed_experts, f"request {i} routing")
    both = engine.generate([PROMPTS[2], PROMPTS[0]], [params[2], params[0]])
    assert both[1].tokens == batch[0].tokens  # position in the batch does not matter either


@pytest.mark.parametrize("preset", ["bf16", "mxfp8", "nvfp4-dequantized"])
def test_a_request_gives_the_same_bytes_at_every_offset_of_a_tile(preset):
    """A filler request of 1..8 tokens ahead of the probe moves the probe's rows through every
    offset of the 8-token tiles (and through every vector lane of the CPU's kernels); its
    tokens, logprobs and routing stay the bytes it gets alone."""
    engine = Engine(tiny(preset), preset, tile=8)
    probe, params = PROMPTS[0], _params(7)
    alone = engine.generate([probe], [params])[0]
    for lead in range(1, 9):
        filler = [(5 * i + lead) % 60 + 1 for i in range(lead)]
        got = engine.generate([filler, probe], [_params(1000 + lead), params])[1]
        assert got.tokens == alone.tokens, f"after a {lead}-token request"
        assert_bytes_equal(got.logprobs, alone.logprobs, f"logprobs after {lead}")
        assert_bytes_equal(got.routed_experts, alone.routed_experts, f"routing after {lead}")


def test_completion_fields_and_stop_tokens():
    engine = Engine(tiny(), "nvfp4-dequantized")
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    assert len(out.tokens) == 6 and out.finish_reason == "length"
    assert out.logprobs.shape == (6,) and out.logprobs.dtype == torch.float32
    assert out.routed_experts.shape == (4, len(PROMPTS[0]) + 6 - 1, 2)
    stop = out.tokens[2]
    first = out.tokens.index(stop)
    stopped = engine.generate(
        [PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[stop])
    )[0]
    assert stopped.tokens == out.tokens[: first + 1] and stopped.finish_reason == "stop"


def test_greedy_is_argmax_of_the_unscaled_distribution():
    engine = Engine(tiny(), "mxfp8")
    out = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=5))[0]
    again = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=5))[0]
    assert out.tokens == again.tokens
    assert (out.logprobs <= 0).all() and (out.logprobs > -10).all()
    top1 = engine.generate([PROMPTS[1]], SamplingParams(top_k=1, max_new_tokens=5, seed=3))[0]
    assert top1.tokens == out.tokens  # top-k 1 is greedy
    assert torch.allclose(top1.logprobs, torch.zeros(5))  # ... and certain under its filter


def test_processed_logprobs_follow_temperature_top_k_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    p = SamplingParams(temperature=0.5, top_k=3)
    lp = processed_logprobs(logits, p)
    assert torch.isinf(lp[3:]).all() and torch.isclose(lp.exp().sum(), torch.tensor(1.0))
    want = torch.log_softmax(logits[:3] / 0.5, -1)
    assert torch.allclose(lp[:3], want)
    nucleus = processed_logprobs(logits, SamplingParams(top_p=0.7))  # p = .61, .22, .14, ..
    assert torch.isfinite(nucleus[:2]).all() and torch.isinf(nucleus[2:]).all()


def test_sampled_tokens_stay_inside_top_k():
    """Every sampled token is one of the two largest logits of its step (the engine's own
    logits for that prefix: its forward is batch invariant), and its logprob is log softmax
    over those two (the spec's transcription): not merely a plausible number."""
    engine = Engine(tiny(), "bf16")
    outs = engine.generate(PROMPTS, SamplingParams(top_k=2, max_new_tokens=8, seed=0))
    runner_up = 0
    for prompt, o in zip(PROMPTS, outs, strict=True):
        prefixes = [prompt + o.tokens[:t] for t in range(len(o.tokens))]
        for t, logits in enumerate(engine.next_token_logits(prefixes)):
            kept = spec.processed_probs(logits.tolist(), top_k=2)
            top2 = set(np.argsort(-logits.double().numpy(), kind="stable")[:2].tolist())
            assert {v for v in range(len(kept)) if kept[v] > 0} == top2
            assert o.tokens[t] in top2, (prompt, t)
            assert o.logprobs[t].item() == pytest.approx(np.log(kept[o.tokens[t]]), abs=1e-5)
            runner_up += o.tokens[t] != int(logits.argmax())
    assert runner_up > 0  # not vacuous: some draws took the second token


def test_engine_holds_weights_as_the_plan_says():
    model = tiny()
    engine = Engine(model, "nvfp4-dequantized")
    experts = engine.weights["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(experts, QTensor) and experts.fmt == "nvfp4"
    assert experts.qdata.dtype == torch.uint8 and experts.qdata.shape == (8, 64, 32)
    last = engine.weights["model.layers.3.mlp.experts.gate_up_proj"]
    assert isinstance(last, torch.Tensor) and last.dtype == torch.bfloat16  # last 15%: bf16
    attn = engine.weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(attn, torch.Tensor) and attn.dtype == torch.bfloat16
    fresh = {r.name: r for r in export_weights(model.named_parameters(), engine.plan)}
    for r in engine.records():
        assert r.hash == fresh[r.name].hash, r.name


def _snapshot(engine):
    return engine.weights_version, engine.generate(
        [PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=4)
    )[0].logprobs


def test_load_weights_refuses_bad_updates_and_keeps_previous_weights():
    model = tiny()
    engine = Engine(model, "mxfp8")
    version, logp = _snapshot(engine)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    good = list(export_weights(model.named_parameters(), engine.plan))

    with pytest.raises(ValueError, match="plan hash mismatch"):
        engine.load_weights(good, "0" * 64)
    tampered = [*good[:-1], dataclasses.replace(good[-1], hash="f" * 64)]
    with pytest.raises(ValueError, match="checksum mismatch"):
        engine.load_weights(tampered, engine.plan.hash())
    with pytest.raises(ValueError, match="incomplete update"):
        engine.load_weights(good[:5], engine.plan.hash())
    wrong = [
        r if "q_proj" not in r.name else WeightRecord(r.name, torch.zeros(3), r.hash) for r in good
    ]
    with pytest.raises(ValueError, match="q_proj"):
        engine.load_weights(wrong, engine.plan.hash())
    unknown = [*good, WeightRecord("model.layers.9.mlp.gate.weight", torch.zeros(1), "x")]
    with pytest.raises(ValueError, match="unknown tensor"):
        engine.load_weights(unknown, engine.plan.hash())
    after_version, after_logp = _snapshot(engine)
    assert after_version == version
    assert_bytes_equal(after_logp, logp, "outputs unchanged after refused loads")

    assert engine.load_weights(good, engine.plan.hash()) == version + 1
    assert not torch.equal(_snapshot(engine)[1], logp)


def test_nan_master_weight_is_refused_by_name():
    """Named as the parameter and as the element of the per-expert HF tensor a user's files
    hold (gate_up_proj [E, 2I, H]: rows I.. of expert e are experts.e.up_proj)."""
    model = tiny()
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[2, 3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj") as err:
        Engine(model, "nvfp4-dequantized")
    assert "first model.layers.1.mlp.experts.2.down_proj.weight[3, 4] = nan" in str(err.value)
    model = tiny()
    inter = model.config.moe_intermediate_size
    with torch.no_grad():
        model.model.layers[0].mlp.experts.gate_up_proj[3, inter + 1, 2] = float("-inf")
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight\[1, 2\] = -inf"):
        Engine(model, "nvfp4-dequantized")


def test_dense_model_has_no_routing():
    cfg = {
        **builtin_config("tiny-moe"),
        "model_type": "qwen3",
        "num_experts": 0,
        "shared_expert_intermediate_size": 0,
    }
    engine = Engine(build_model(cfg, seed=0), "mxfp8")
    out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3, seed=0))[0]
    assert out.routed_experts is None and len(out.tokens) == 3


def test_bad_requests_are_refused():
    engine = Engine(tiny(), "bf16")
    with pytest.raises(ValueError, match="prompt 1"):
        engine.generate([[1, 2], [99]], SamplingParams())
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        engine.generate([[1]], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_grouped_low_bit_experts_need_per_token_nvfp4_activations():
    """The packed grouped path runs every expert's rows in one launch, so it takes only
    per-row activation scales; a per-tensor NVFP4 plan keeps the per-expert tiles."""
    from types import SimpleNamespace

    from mxrl.kernels import Backend
    from mxrl.nn.paths.rollout import Grouping, RolloutExperts

    plan = Engine(tiny("nvfp4-hp"), "nvfp4-hp").plan
    specs = {
        "gate_up": plan["model.layers.0.mlp.experts.gate_up_proj"],
        "down": plan["model.layers.0.mlp.experts.down_proj"],
    }
    assert all(s.activations == "per_token" for s in specs.values())
    experts = SimpleNamespace(num_experts=8)

    def grouped(specs, backend=Backend.TRITON):
        experts_ = RolloutExperts(experts, specs, torch.bfloat16, 8, backend)
        return experts_.grouping is Grouping.LOW_BIT

    assert grouped(specs)
    assert not grouped(specs, Backend.REFERENCE)
    per_tensor = {k: dataclasses.replace(s, activations="per_tensor") for k, s in specs.items()}
    assert not grouped(per_tensor)


def test_engine_takes_the_runs_kernels_record():
    from mxrl.kernels import Kernels

    record = Kernels.resolve("reference", "cpu")
    engine = Engine(tiny("mxfp8"), "mxfp8", backend=record, tile=8)
    assert engine.kernels is record and engine.backend == "reference"
    assert not engine.fused_sampler
    cuda = dataclasses.replace(record, device=torch.device("cuda"))
    with pytest.raises(ValueError, match="resolved for cuda, but the engine runs on cpu"):
        Engine(tiny("mxfp8"), "mxfp8", backend=cuda, tile=8)
