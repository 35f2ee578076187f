"""benchmarks/paged_attention.py shrunk to the interpreter: the engine's kernel row gives its own
bytes, the engine's `attention_split` (several splits of a 100-key context) gives the same
attention within bf16 rounding, and every row is reported."""

from __future__ import annotations

import torch

from tests.benchmark_scripts import load_benchmark
from tests.kernels.test_decode_gemm import interpreter


@interpreter
def test_the_benchmark_on_the_interpreter(monkeypatch, capsys):
    bench = load_benchmark("paged_attention", monkeypatch)
    rows = bench.run(100, [2], torch.device("cpu"))
    assert [r["variant"] for r in rows] == ["engine", "engine attention_split 32"]
    engine, engine_split = rows
    assert engine["same_bytes"] and engine["max_abs_diff"] == 0.0
    assert engine_split["max_abs_diff"] <= 2**-7  # 4 splits; bf16 averages of values ~N(0, 1)
    for r in rows:
        assert r["batch"] == 2 and r["context"] == 100 and r["ms"] > 0
        assert r["kv_bytes"] == 2 * 2 * 100 * 4 * 128 * 2 and r["floor_ms"] is None
    out = capsys.readouterr().out
    assert "context 100" in out and out.count("B=   2") == 2
