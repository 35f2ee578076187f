"""benchmarks/rollout.py end to end on the CPU, shrunk (--tiny --skip-hf): decode rows per preset
and batch, the RL-shaped row (prompt groups sharing their prompt), the results file keeping the
other sections; and profile_generate.py's RL-shaped profile."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_tiny_cpu_run_writes_decode_and_rl_rows(tmp_path, monkeypatch):
    rollout = load_benchmark("rollout", monkeypatch)
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"sync": {"kept": True}}))
    args = ["--tiny", "--device", "cpu", "--skip-hf", "--layers", "1", "--presets", "bf16",
            "--modes", "invariant", "stepwise", "--batch", "1", "2", "--prompt", "8",
            "--new-tokens", "3", "--repeats", "1", "--rl", "--groups", "2", "--samples", "2",
            "--rl-prompt", "20", "--rl-new-tokens", "6", "--eos-every", "40",
            "--out", str(out)]  # fmt: skip
    assert rollout.main(args) == 0
    data = json.loads(out.read_text())
    assert data["sync"] == {"kept": True}
    section = data["rollout"]
    assert section["complete"] is True
    got = {(r["mode"], r["B"]) for r in section["rows"]}
    assert got == {(m, b) for m in ("invariant", "stepwise") for b in (1, 2)}
    for r in section["rows"]:
        assert r["ms_step"] > 0 and r["prefill_plus_one_s"] > 0 and r["step_bytes"] > 0
    (rl,) = section["rl"]["rows"]
    assert rl["sequences"] == 4 and 0 < rl["generated_tokens"] <= 4 * 6
    # the two samples of a prompt share its full block (16 of its 20 tokens): per prompt one
    # shared block and one of each sample's own (at most 25 tokens each), 6 blocks, not 8
    assert rl["peak_kv_blocks"] <= 6


def test_profile_generate_rl_prints_the_decode_steps_by_size(monkeypatch, capsys):
    profile = load_benchmark("profile_generate", monkeypatch)
    args = ["--rl", "--tiny", "--device", "cpu", "--layers", "1", "--groups", "2",
            "--samples", "2", "--rl-prompt", "20", "--rl-new-tokens", "5", "--top", "3"]  # fmt: skip
    assert profile.main(args) == 0
    text = capsys.readouterr().out
    assert "== RL bf16: 4 sequences" in text and "decode steps of <= 8 rows" in text


def test_profile_generate_prefill_runs_on_the_cpu(monkeypatch, capsys):
    """The prefill profile (the default mode) on the CPU: its ops by own CPU time (it asked the
    profiler for CUDA activity only, and failed there); the engine's dense_gemm in the title."""
    profile = load_benchmark("profile_generate", monkeypatch)
    args = ["--tiny", "--device", "cpu", "--layers", "1", "--batch", "2", "--prompt", "8",
            "--dense-gemm", "grouped", "--top", "3"]  # fmt: skip
    assert profile.main(args) == 0
    text = capsys.readouterr().out
    assert "== bf16 [grouped] B=2 prompt 8" in text and "aten::" in text
