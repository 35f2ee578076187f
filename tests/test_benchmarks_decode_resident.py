"""benchmarks/decode_resident.py shrunk to the CPU: the window holds only steps that decoded every
request, its keys and K/V bytes are counted by hand, and the split rows compare their
completions with the one-pass rows."""

from __future__ import annotations

import json

import pytest

from mxrl.engine import Engine, SamplingParams
from mxrl.models import build_model
from tests.benchmark_scripts import load_benchmark
from tests.models.configs import CONFIGS


def test_the_engine_counts_each_decode_steps_rows_and_keys():
    """Two prompts of 5 and 9 tokens, 4 new tokens each, one step at a time: one prefill step
    (both prompts fit the token budget), then three decode-only steps of both requests; the
    k-th reads 5 + k and 9 + k keys (the cached tokens and its own)."""
    engine = Engine(build_model(CONFIGS["qwen3_moe-norm-dense1"], seed=0), "bf16", device="cpu")
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14]]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4))
    st = engine.stats
    assert st.decode_step_rows == [2, 2, 2]
    assert st.decode_step_keys == [(5 + 1) + (9 + 1), (5 + 2) + (9 + 2), (5 + 3) + (9 + 3)]
    assert len(st.decode_step_s) == 3 and all(s > 0 for s in st.decode_step_s)


def test_the_benchmark_on_the_cpu(monkeypatch, tmp_path, capsys):
    bench = load_benchmark("decode_resident", monkeypatch)
    out = tmp_path / "r.json"
    argv = ["--tiny", "--device", "cpu", "--presets", "bf16", "--batch", "2", "3", "--prompt",
            "40", "--new-tokens", "10", "--window", "4", "--split", "0", "16", "--vocab", "256",
            "--kv-cache", "fp8", "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    section = json.loads(out.read_text())["decode_resident"]
    rows = section["rows"]
    assert [(r["attention_split"], r["batch"]) for r in rows] == [(0, 2), (0, 3), (16, 2), (16, 3)]
    # tiny layer: 4 layers, 2 KV heads of 16; FP8 E4M3 codes (1 byte) and one fp32 scale per
    # token and head for K and for V: 2 x 2 x (16 + 4) = 80 bytes a token and layer
    for r in rows:
        b = r["batch"]
        assert r["window_steps"] == 4 and r["kv_cache"] == "fp8"
        # three prompts of 40 fit one step: each of the first 4 decode steps feeds token 40 + k
        assert r["window_keys_per_layer"] == b * (40 + 2.5)
        assert r["step_kv_bytes"] == 4 * b * (40 + 2.5) * 80
        assert r["step_floor_bytes"] == r["step_weight_bytes"] + r["step_kv_bytes"]
        assert r["same_completions"] == b  # the CPU's attention does not split: the same tokens
        assert r["floor_ms"] is None and r["step_ms"] > 0
    assert "same as split 0" in capsys.readouterr().out


def test_the_first_split_must_be_the_one_pass(monkeypatch):
    bench = load_benchmark("decode_resident", monkeypatch)
    with pytest.raises(SystemExit):
        bench.parse_args(["--split", "512", "0"])
