"""benchmarks/largest_slice.py on the CPU: per preset and rl.hold_bf16_weights, the most layers
whose memory estimate passes, one more refused; auto never fits fewer layers than true."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.benchmark_scripts import load_benchmark


def test_the_largest_slice_passes_and_one_more_is_refused(tmp_path, monkeypatch):
    ls = load_benchmark("largest_slice", monkeypatch)
    out = tmp_path / "largest.json"
    args = ["--capacity-gib", "60", "--presets", "bf16", "mxfp8", "--max-layers", "12",
            "--out", str(out)]  # fmt: skip
    assert ls.main(args) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["capacity_bytes"] == 60 * 2**30
    rows = {(r["preset"], r["hold_bf16_weights"]): r for r in data["rows"]}
    assert set(rows) == {(p, h) for p in ("bf16", "mxfp8") for h in ("auto", True, False)}
    parsed = argparse.Namespace(prompts=32, samples=8, new_tokens=256)
    for (preset, hold), r in rows.items():
        assert 1 <= r["layers"] < 12, (preset, hold)
        ls.estimate(preset, hold, r["layers"], 60 * 2**30, parsed).check()
        with pytest.raises(ValueError, match="memory: the run needs more"):
            ls.estimate(preset, hold, r["layers"] + 1, 60 * 2**30, parsed).check()
        assert r["one_more_refused"].startswith("memory: the run needs more")
    for preset in ("bf16", "mxfp8"):
        assert rows[(preset, "auto")]["layers"] >= rows[(preset, True)]["layers"]
        assert rows[(preset, "auto")]["layers"] == max(
            rows[(preset, True)]["layers"], rows[(preset, False)]["layers"]
        )
