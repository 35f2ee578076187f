"""benchmarks/routing_record.py on the CPU, shrunk: the parts a rollout's requests hold when it
ends are one a block of 16 (joined as each block fills) plus the rows of the last, partly
filled block, and the completions are the engine's own."""

from __future__ import annotations

from tests.benchmark_scripts import load_benchmark


def test_the_parts_joined_are_one_a_block(monkeypatch, capsys):
    routing_record = load_benchmark("routing_record", monkeypatch)
    rows = []
    real = routing_record.measure
    monkeypatch.setattr(routing_record, "measure", lambda *a: rows.append(real(*a)) or rows[-1])
    args = ["--requests", "3", "--prompt", "8", "--new-tokens", "40"]
    assert routing_record.main(args) == 0
    (row,) = rows
    assert row["tokens"] == 3 * 40
    # each request: its prompt (8 positions) and 39 decode rows, 47 positions in 16-blocks:
    # blocks 0 and 1 joined as they filled (2 parts), then the 15 rows of block 2 one each
    assert row["parts"] == 3 * (2 + 15)
    assert 0 < row["completions_s"] < row["rollout_s"]
    assert "51 routing parts (17 a request)" in capsys.readouterr().out
