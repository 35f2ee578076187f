"""benchmarks/engine_decode.py end to end on the CPU, shrunk (--tiny --quick): every preset gets
its weight and decode rows, greedy decoding is deterministic, the results file keeps the other
sections, and a preset or device that is not there stops the script with a message; the
DeepSeek-V3 slice (`--family deepseek-v3`) with its HF rows and MLA byte floor."""

from __future__ import annotations

import json

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

BATCHES = [1, 3]


@pytest.fixture(scope="module")
def engine_decode():
    with pytest.MonkeyPatch.context() as mp:
        yield load_benchmark("engine_decode", mp)


def test_tiny_cpu_run_writes_every_preset(engine_decode, tmp_path):
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"decode_gemm": {"kept": True}}))
    args = ["--tiny", "--quick", "--device", "cpu", "--out", str(out)]
    args += ["--batch", *map(str, BATCHES), "--prompt", "4", "--new-tokens", "3"]
    assert engine_decode.main(args) == 0

    data = json.loads(out.read_text())
    assert data["decode_gemm"] == {"kept": True}
    section = data["engine_decode"]
    presets = list(engine_decode.DEFAULT_PRESETS)
    assert [w["preset"] for w in section["weights"]] == presets
    for w in section["weights"]:
        # no ordering of bytes is asserted: the CPU engine also holds dequantized fp32 operands
        assert w["held_bytes"] > 0 and w["contract_bytes"] > 0
        assert w["gpu_allocated_bytes"] is None  # CPU: no memory_allocated
        assert w["held_bytes_vs_bf16"] > 0 and w["contract_bytes_vs_bf16"] > 0
        assert w["backend"] == "reference"
        assert w["deterministic"] is True and w["batch_invariant"] is True
    quantized = {w["preset"]: w["params_by_format"] for w in section["weights"]}
    assert set(quantized["bf16"]) == {"bf16"}
    assert quantized["mxfp8"]["mxfp8"] > 0 and quantized["nvfp4-dequantized"]["nvfp4"] > 0
    assert [(r["preset"], r["batch"]) for r in section["rows"]] == [
        (p, b) for p in presets for b in BATCHES
    ]
    for r in section["rows"]:
        assert r["tokens_per_s"] > 0 and r["total_s"] > 0
        assert r["ms_per_step"] is None or r["ms_per_step"] > 0  # None: CPU timing noise
        assert r["decode_step_ms"] > 0  # 3 new tokens: 2 decode-only steps a call
        assert r["step_weight_bytes"] > 0
        assert r["deterministic"] is True and r["logprobs_identical"] is True
    assert section["settings"]["new_tokens"] == 3 and section["settings"]["batches"] == BATCHES


def test_unknown_preset_is_refused_with_the_close_names(engine_decode):
    with pytest.raises(SystemExit, match="nvfp4-dequantized"):
        engine_decode.main(["--tiny", "--device", "cpu", "--presets", "bf16", "nvfp4"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_cuda_is_refused(engine_decode):
    with pytest.raises(SystemExit, match="no CUDA device"):
        engine_decode.main(["--tiny", "--device", "cuda"])


def test_deepseek_tiny_cpu_run_has_hf_rows_and_the_mla_floor(engine_decode, tmp_path):
    """--family deepseek-v3: its own section (the Qwen one kept), transformers' rows on the same
    weights, and the K/V floor of the expanded cache and of a latent one, from the shapes."""
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"engine_decode": {"kept": True}}))
    args = ["--family", "deepseek-v3", "--tiny", "--quick", "--device", "cpu", "--layers", "3",
            "--batch", "1", "2", "--prompt", "4", "--new-tokens", "3", "--presets", "bf16",
            "fp8-block", "--out", str(out)]  # fmt: skip
    assert engine_decode.main(args) == 0

    data = json.loads(out.read_text())
    assert data["engine_decode"] == {"kept": True}
    section = data["engine_decode_deepseek_v3"]
    model = section["model"]
    assert model["family"] == "deepseek-v3" and model["model_type"] == "deepseek_v3"
    assert 0 < model["active_params_per_token"] < model["num_params"]
    hf = [r for r in section["rows"] if r["preset"] == "hf"]
    assert [r["batch"] for r in hf] == [1, 2]
    assert all(r["tokens_per_s"] > 0 and r["experts_implementation"] for r in hf)
    assert all(r["transformers"] for r in hf)
    ours = [r for r in section["rows"] if r["preset"] != "hf"]
    assert [(r["preset"], r["batch"]) for r in ours] == [
        (p, b) for p in ("bf16", "fp8-block") for b in (1, 2)
    ]
    # per token and layer: 4 heads x (16 + 8 key + 16 value) bf16 expanded; 32 + 8 bf16 latent
    expanded, latent = 4 * (16 + 8 + 16) * 2, (32 + 8) * 2
    for r in ours:
        tokens = r["batch"] * ((4 + 1) + (4 + 2)) / 2  # the 2 decode steps read 5, then 6
        assert r["step_kv_bytes"] == pytest.approx(3 * tokens * expanded)
        assert r["step_kv_latent_bytes"] == pytest.approx(3 * tokens * latent)
        assert r["step_floor_bytes"] == pytest.approx(r["step_weight_bytes"] + r["step_kv_bytes"])
        assert r["deterministic"] is True
        hf_ms = next(h["ms_per_step"] for h in hf if h["batch"] == r["batch"])
        if hf_ms and r["ms_per_step"]:  # None: CPU timing noise
            assert r["speedup_vs_hf"] == pytest.approx(hf_ms / r["ms_per_step"])


def test_weight_bytes_by_position_counts_the_experts_of_the_requests_still_decoding(
    engine_decode,
):
    """Requests of different lengths in lockstep: step s reads the dense weights and, per MoE
    layer, one expert's bytes for each expert the requests still feeding a token at position
    prompt + s were routed to (counted here by brute force over those requests)."""
    from mxrl.arch import builtin_config
    from mxrl.engine import Engine, SamplingParams
    from mxrl.models import build_model

    engine = Engine(build_model(builtin_config("tiny-moe"), seed=0), "bf16", tile=16)
    prompts = [[1 + (7 * i + j) % 60 for j in range(12)] for i in range(4)]
    outs = engine.generate(
        prompts, [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (3, 9, 6, 1)]
    )
    per_step = engine_decode.weight_bytes_by_position(engine, outs, 12)
    assert len(per_step) == 8  # the longest request feeds 8 of its 9 tokens
    experts = engine.config.num_experts
    by_layer, dense = {}, 0
    for name, v in engine.weights.items():
        nbytes = v.numel() * v.element_size()  # bf16: plain tensors
        if ".mlp.experts." in name:
            layer = name.split(".mlp.experts.")[0]
            by_layer[layer] = by_layer.get(layer, 0) + nbytes // experts
        elif not name.endswith("embed_tokens.weight"):
            dense += nbytes
    for s, got in enumerate(per_step):
        live = [o for o in outs if len(o.tokens) - 1 > s]
        want = dense
        for j, layer in enumerate(engine.config.moe_layers):
            active = torch.cat([o.routed_experts[j, 12 + s] for o in live]).unique().numel()
            want += active * by_layer[f"model.layers.{layer}"]
        assert got == want, s
    assert per_step[0] > per_step[-1]  # three requests decode at step 0, one at the last
    alone = engine_decode.weight_bytes_by_position(engine, [outs[3]], 12)  # one token: no step
    assert alone == [dense]
