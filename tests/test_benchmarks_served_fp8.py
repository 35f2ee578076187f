"""benchmarks/served_fp8.py's logic on the CPU: transformers dequantizes the block-FP8 export at
load (its CPU path), the comparisons and the corrupted-scale control are computed and recorded.
The bound itself is measured on the H200 (tests/weights/test_served_gpu.py, docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark


def test_tiny_cpu_run_records_every_comparison(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    with pytest.MonkeyPatch.context() as mp:
        module = load_benchmark("served_fp8", mp)
    out = tmp_path / "r.json"
    args = ["--tiny", "--dequantize", "--layers", "2", "--vocab", "512", "--prompts", "4"]
    result = module.main([*args, "--prompt-len", "16", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    for key in ("fp8_tf_vs_mxrl", "bf16_tf_vs_mxrl", "mxrl_fp8_vs_bf16", "fp8_corrupt_vs_mxrl"):
        assert set(result[key]) == {"max_abs", "max_abs_rel", "mean_kl", "max_kl", "top1_agree"}
    # shifting the scales must show: the control is far from the engine, the export is not
    assert result["fp8_corrupt_vs_mxrl"]["mean_kl"] > 5 * result["fp8_tf_vs_mxrl"]["mean_kl"]
    assert result["within_bound"] is module.within_bound(result)
