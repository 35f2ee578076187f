"""benchmarks/train_step.py end to end on the CPU (--tiny): every preset gets a row with its ratio
to bf16, with the reference and with the tensor-core GEMMs (their logic on the CPU), and the
results file keeps the other sections."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def train_step():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))  # the script imports benchmarks/common.py
        spec = importlib.util.spec_from_file_location("train_step", BENCHMARKS / "train_step.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module


@pytest.mark.parametrize("gemm", ["reference", "tensor_core"])
def test_tiny_cpu_run_writes_every_preset(train_step, tmp_path, gemm):
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"rollout": {"kept": True}}))
    args = ["--tiny", "--device", "cpu", "--skip-hf", "--warmup", "0", "--repeats", "1"]
    assert train_step.main([*args, "--gemm", gemm, "--layers", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["rollout"] == {"kept": True}
    section = data["train_step"]
    assert section["gemm"] == gemm
    rows = section["rows"]
    assert [r["preset"] for r in rows] == list(train_step.DEFAULT_PRESETS)
    assert all(r["s_step"] > 0 and r["tokens"] == 32 for r in rows)
    assert rows[0]["x_bf16"] == 1.0
