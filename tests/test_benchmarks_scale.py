"""benchmarks/scale.py end to end on the CPU, shrunk (--tiny, gloo): the single-process run and
the split placement under torchrun each get a row with the step split into rollout / sync /
train, and the split run's engine holds the single run's bytes (equal sync digests)."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_tiny_cpu_run_compares_split_with_single(tmp_path, monkeypatch):
    module = load_benchmark("scale", monkeypatch, "scale_bench")
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"sync": {"kept": True}}))
    args = ["--tiny", "--device", "cpu", "--steps", "2", "--prompts", "2", "--samples", "2",
            "--new-tokens", "4", "--placements", "single", "split",
            "--workdir", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    assert module.main(args) == 0
    data = json.loads(out.read_text())
    assert data["sync"] == {"kept": True}
    rows = {r["placement"]: r for r in data["scale"]["rows"]}
    assert set(rows) == {"single", "split"}
    for r in rows.values():
        assert r["rc"] == 0 and r["steps"] == 2 and r["sync_ok"]
        assert r["step_s"] == r["rollout_s"] + r["sync_s"] + r["train_s"] > 0
        assert len(r["sync_digests"]) == 2 and all(r["sync_digests"])
    assert rows["split"]["digests_equal_single"] is True
    assert {"rank0/train_s", "rank1/rollout_s"} <= set(rows["split"]["per_rank"])
