"""benchmarks/gc_rollout.py on the CPU, shrunk: the three rows, and the paused rollout's
collector silent but for the young collection due as it comes back on, with nothing
unreachable left behind."""

from __future__ import annotations

import gc

from tests.benchmark_scripts import load_benchmark


def test_three_rollouts_and_the_paused_one_leaves_nothing(monkeypatch, capsys):
    gc_rollout = load_benchmark("gc_rollout", monkeypatch)
    rows = []
    real = gc_rollout.rollout
    monkeypatch.setattr(gc_rollout, "rollout", lambda *a: rows.append(real(*a)) or rows[-1])
    assert gc_rollout.main(["--prompts", "2", "--samples", "2", "--new-tokens", "12"]) == 0
    assert [r["collector"] for r in rows] == ["collector on", "heap frozen", "collector paused"]
    assert len({r["tokens"] for r in rows}) == 1  # the same rollout each time
    paused = rows[-1]
    assert set(paused["pauses"]) <= {0} and paused["pauses"].get(0, [0])[0] <= 1
    assert paused["unreachable_after"] == 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    printed = capsys.readouterr().out
    assert printed.count("tracked objects") == 3 and "0 unreachable objects" in printed
