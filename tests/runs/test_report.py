"""compare(): one PNG per subject with every run as a series, and the markdown table."""

from __future__ import annotations

import pytest

from mxrl.runs import compare, summarize
from tests.runs.synthetic import write_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _row(markdown: str, name: str) -> list[str]:
    (line,) = [ln for ln in markdown.splitlines() if ln.startswith(f"| {name} |")]
    return [c.strip() for c in line.strip("|").split("|")][1:]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    bf16 = write_run(root, "a-bf16", "bf16", spike_at=None)
    nvfp4 = write_run(root, "b-nvfp4", "nvfp4-dequantized", spike_at=12, sync_fail_at=20)
    out = root.parent / "report"
    return bf16, nvfp4, compare([bf16.path, nvfp4], out)


def test_compare_writes_every_figure(two_runs):
    *_, result = two_runs
    assert set(result.figures) == {"reward", "mismatch", "grad_norm", "step_time"}
    assert result.skipped == ()
    for name, path in result.figures.items():
        assert path == result.out_dir / f"{name}.png"
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 5000, name


def test_comparison_table(two_runs):
    *_, result = two_runs
    md = result.markdown.read_text()
    assert result.markdown.name == "comparison.md" and result.table in md
    assert _row(md, "metric")[:2] == ["bf16", "nvfp4-dequantized"]  # labelled by config.recipe
    assert _row(md, "run id") == ["`a-bf16`", "`b-nvfp4`"]
    assert _row(md, "steps logged") == ["30", "30"]
    assert _row(md, "reward/mean, final") == ["0.68", "0.68"]
    assert _row(md, "reward/mean, mean") == ["0.39", "0.39"]
    assert _row(md, "gradient spikes") == ["0", "1 (steps 12)"]
    assert _row(md, "weight syncs verified") == ["yes (30/30)", "**no** (29/30)"]
    assert _row(md, "grad/norm, max") == ["1", "21"]
    assert _row(md, "min layer SQNR at last export (dB)") == ["19.5", "19.5"]
    assert _row(md, "step time, mean (s)") == ["1.6", "1.6"]
    assert _row(md, "throughput/tokens_per_s, mean") == ["1234", "1234"]
    for name in ("reward", "mismatch", "grad_norm", "step_time"):
        assert f"![{name}]({name}.png)" in md


def test_missing_metrics_are_skipped(tmp_path):
    reward_only = write_run(tmp_path, "r", None, keys=("reward/mean",), spike_at=None)
    result = compare([reward_only], tmp_path / "out")
    assert set(result.figures) == {"reward"}
    assert result.skipped == ("mismatch", "grad_norm", "step_time")
    assert not (tmp_path / "out" / "mismatch.png").exists()
    md = result.markdown.read_text()
    assert _row(md, "metric")[0] == "r"  # no recipe: labelled by run id
    assert _row(md, "mismatch/k3, mean") == ["—"]
    assert _row(md, "accuracy, final") == ["—"]
    assert "Not plotted (no run logged the metrics): mismatch, grad_norm, step_time." in md


def test_spike_events_alone_count(tmp_path):
    rec = write_run(tmp_path, "r", "mxfp8", spike_at=None, steps=5)
    rec.log_spike(3, 9.0, 5.0)
    assert summarize(rec).spike_steps == [3]


def test_same_recipe_labels_and_truncated_runs(tmp_path):
    a = write_run(tmp_path, "a", "mxfp8", steps=6, spike_at=None, keys=("reward/mean",))
    b = write_run(tmp_path, "b", "mxfp8", steps=6, spike_at=None, keys=("reward/mean",))
    with open(b.path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')
    result = compare([a, b], tmp_path / "out")
    md = result.markdown.read_text()
    assert _row(md, "metric")[:2] == ["mxfp8 [a]", "mxfp8 [b]"]
    assert _row(md, "steps logged") == ["6", "6"]
    assert list(result.problems) == ["b"] and "truncated last line" in result.problems["b"][0]
    assert "## Problems reading the records" in md


def test_compare_needs_a_run(tmp_path):
    with pytest.raises(ValueError, match="at least one run"):
        compare([], tmp_path)
