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
    assert set(result.figures) == {"heldout", "reward", "mismatch", "grad_norm", "step_time"}
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
    assert result.skipped == ("heldout", "mismatch", "grad_norm", "step_time")
    assert not (tmp_path / "out" / "mismatch.png").exists()
    md = result.markdown.read_text()
    assert _row(md, "metric")[0] == "r"  # no recipe: labelled by run id
    assert _row(md, "mismatch/k3, mean") == ["—"]
    assert _row(md, "accuracy, final") == ["—"]
    assert "Not plotted (no run logged the metrics): heldout, mismatch, grad_norm, step_time." in md


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


def _axes_of(fig):
    return fig.get_axes()


def test_seeds_of_a_recipe_are_one_mean_line_with_a_standard_error_band(tmp_path):
    from mxrl.runs.plots import RunSeries, _groups, _mean_and_stderr, plot_reward

    recs = [write_run(tmp_path, f"nv-{i}", "nvfp4-dequantized", spike_at=None) for i in range(3)]
    other = write_run(tmp_path, "bf", "bf16", spike_at=None)
    # shift the seeds' rewards apart: +0, +0.1, +0.2 at every step
    for i, rec in enumerate(recs):
        rows = rec.metrics()
        (rec.path / "metrics.jsonl").write_text("")
        for row in rows:
            step = row.pop("step")
            rec.log_metrics(step, {**row, "reward/mean": row["reward/mean"] + 0.1 * i})
    runs = [
        RunSeries(r.run_id, "C0", summarize(r), r.metrics(), r.events()) for r in [*recs, other]
    ]
    groups = _groups(runs)
    assert [len(g) for g in groups] == [3, 1]
    steps, means, errors = _mean_and_stderr(groups[0], "reward/mean")
    assert steps == list(range(30))
    assert means[0] == pytest.approx(0.1 + 0.1)  # mean of 0.1, 0.2, 0.3
    assert errors[0] == pytest.approx(0.1 / 3**0.5)  # std 0.1 over 3 seeds
    fig = plot_reward(runs)
    (ax,) = [a for a in _axes_of(fig) if a.get_title().startswith("reward/mean")]
    assert "standard error over seeds" in ax.get_title()
    assert ax.get_xlabel() == "GRPO step" and ax.get_ylabel() == "mean reward per step"
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["nvfp4-dequantized (mean of 3 seeds)", "bf16"]
    assert len(ax.collections) == 1  # one band: the seeded recipe; none for the single run
    assert all(float(t).is_integer() for t in ax.get_xticks())


def test_accuracy_is_not_plotted_again_when_it_is_the_reward(tmp_path):
    from mxrl.runs.plots import RunSeries, plot_reward

    rec = write_run(tmp_path, "r", "bf16", keys=("reward/mean", "accuracy"), spike_at=None)
    runs = [RunSeries("r", "C0", summarize(rec), rec.metrics(), rec.events())]
    assert len(_axes_of(plot_reward(runs))) == 2  # synthetic accuracy differs from reward
    rows = rec.metrics()
    (rec.path / "metrics.jsonl").write_text("")
    for row in rows:
        step = row.pop("step")
        rec.log_metrics(step, {**row, "accuracy": row["reward/mean"]})
    runs = [RunSeries("r", "C0", summarize(rec), rec.metrics(), rec.events())]
    (ax,) = _axes_of(plot_reward(runs))
    assert ax.get_title() == "reward/mean"
