"""benchmarks/sync.py end to end on the CPU, shrunk (--tiny): every preset gets its row, the
48-layer extrapolation's byte formula equals the engine's bytes on the slice, the results file
keeps the other sections. Its old --nccl flag points to benchmarks/sync_nccl.py, which parses
the shared options and asks for two ranks."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def sync_bench():
    with pytest.MonkeyPatch.context() as mp:
        yield load_benchmark("sync", mp, "sync_bench")


def test_tiny_cpu_run_writes_every_preset(sync_bench, tmp_path):
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"rollout": {"kept": True}}))
    args = ["--tiny", "--device", "cpu", "--repeats", "1", "--layers", "2", "--out", str(out)]
    assert sync_bench.main(args) == 0
    data = json.loads(out.read_text())
    assert data["rollout"] == {"kept": True}
    section = data["sync"]
    assert section["mode"] == "in_process" and section["copy_bandwidth"]["gbps"] > 0
    assert [r["preset"] for r in section["rows"]] == list(sync_bench.DEFAULT_PRESETS)
    tiny = sync_bench.config_of(2, 256, True)  # --tiny caps the vocabulary at 256
    params = sum(p.numel() for p in sync_bench.build_model(tiny).parameters())
    for r in section["rows"]:
        assert r["engine_bytes"] == r["engine_bytes_formula"] > 0
        assert r["sync_s"] > 0 and r["gbps"] > 0 and r["sync_with_sqnr_s"] > 0
        assert r["sync_s_48_layers"] > r["sync_s"]
        assert set(r["share"]) == {"quantize", "checksum", "transfer", "load"}
        assert abs(sum(r["share"].values()) - 1) < 1e-9 and r["share"]["transfer"] == 0
        assert r["peak_extra_bytes"] is None  # CPU: no allocator statistics
        # the byte floor: the fp32 masters (4 bytes a parameter) read twice, the engine bytes
        # written, checksummed twice and copied in (read + write)
        assert r["floor_bytes"] == 2 * 4 * params + 5 * r["engine_bytes"]
        floor_s = r["floor_bytes"] / (section["copy_bandwidth"]["gbps"] * 1e9)
        assert r["floor_s"] == pytest.approx(floor_s, rel=1e-12)
        assert r["x_floor"] == pytest.approx(r["sync_s"] / floor_s, rel=1e-12)
        assert r["floor_gbps"] == pytest.approx(r["engine_bytes"] / floor_s / 1e9, rel=1e-12)
    assert section["environment"]["device"].startswith("cpu")


def test_nccl_flag_points_to_sync_nccl(sync_bench, capsys):
    assert sync_bench.main(["--nccl", "--layers", "2", "--repeats", "2"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc-per-node 2 benchmarks/sync_nccl.py" in err
    assert err.count("\n") == 1  # one line, no traceback


def test_sync_nccl_parses_and_asks_for_two_ranks(monkeypatch):
    nccl_bench = load_benchmark("sync_nccl", monkeypatch, "sync_nccl_bench")
    args = nccl_bench.parse_args(["--tiny", "--layers", "2", "--repeats", "2"])
    assert (args.layers, args.repeats, args.vocab) == (2, 2, 256)  # --tiny caps the vocabulary
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match=r"torchrun --nproc-per-node 2 benchmarks/sync_nccl\.py"):
        nccl_bench.nccl(args)
