"""benchmarks/engine_decode.py end to end on the CPU, shrunk (--tiny --quick): every preset gets
its weight and decode rows, greedy decoding is deterministic, the results file keeps the other
sections, and a preset or device that is not there stops the script with a message."""

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
