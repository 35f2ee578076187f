"""benchmarks/rl_step.py end to end on the CPU, shrunk (--tiny): a row per preset and per
`kv_cache: fp8` variant with every stage timed and its Δ% against bf16, every preset generating
exactly the seeded response lengths, the results file keeping the other sections."""

from __future__ import annotations

import gc
import json

import pytest

from tests.benchmark_scripts import load_benchmark


def test_response_lengths_are_seeded_and_spread(monkeypatch):
    rl_step = load_benchmark("rl_step", monkeypatch)
    lengths = rl_step.response_lengths(512, 4096, seed=0)
    assert lengths == rl_step.response_lengths(512, 4096, seed=0)
    assert min(lengths) == 16 and max(lengths) == 4096  # a tail at the limit
    assert 1000 < sum(lengths) / 512 < 1500  # mean about 4096 / 3, most short
    assert sorted(lengths)[256] < 1000


def test_tiny_cpu_run_writes_a_row_per_preset(tmp_path, monkeypatch):
    rl_step = load_benchmark("rl_step", monkeypatch)
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"rollout": {"kept": True}}))
    args = ["--tiny", "--device", "cpu", "--layers", "1", "--presets", "bf16", "--kv-fp8",
            "--prompts", "2", "--samples", "2", "--prompt", "8", "--new-tokens", "40",
            "--steps", "1", "--tile", "16", "--attention-split", "32", "--dense-gemm", "grouped",
            "--out", str(out)]  # fmt: skip
    assert rl_step.main(args) == 0
    data = json.loads(out.read_text())
    assert data["rollout"] == {"kept": True}
    section = data["rl_step"]
    rows = {r["preset"]: r for r in section["rows"]}
    assert list(rows) == ["bf16", "bf16+kv-fp8"]
    lengths = rl_step.response_lengths(4, 40, seed=0)
    assert len(set(lengths)) > 1  # the lengths differ from request to request
    for r in rows.values():
        assert all(r[k] > 0 for k in ("rollout_s", "train_s", "sync_s", "step_s"))
        assert r["step_s"] >= r["rollout_s"] + r["train_s"] + r["sync_s"]
        assert r["response_len_mean"] == sum(lengths) / 4  # the seeded lengths, every preset
        assert r["attention_split"] == 32  # rl.engine_attention_split, as the engine ran
        assert r["dense_gemm"] == "grouped"  # rl.engine_dense_gemm (a no-op on the CPU)
        (phases,) = r["sync_phases"]  # one timed step's sync; allocator counts: CUDA only
        assert set(phases) == {"export_s", "update_s", "digest_s", "gc_s", "gc_collections"}
        parts = phases["export_s"] + phases["update_s"] + phases["digest_s"]
        assert 0 < parts <= r["sync_s"]  # the phases lie inside the loop's timed sync
        assert len(r["gc_step_s"]) == 1 and r["gc_step_s"][0] >= phases["gc_s"] >= 0
        # each timed step's seconds (one here, so the median is that step's)
        assert r["per_step"] == {k: [r[k]] for k in ("rollout_s", "train_s", "sync_s", "step_s")}
        (rollout,) = r["rollout_parts"]  # the timed step's rollout by live sequences
        assert rollout["decode_s"] + rollout["other_s"] == pytest.approx(r["rollout_s"])
        assert 0 < rollout["decode_s"] < r["rollout_s"]
        assert sum(b["steps"] for b in rollout["by_rows"]) == rollout["decode_steps"]
        # 4 requests: the longest decodes alone at the end, and at most 40 decode steps
        assert [b["rows"] for b in rollout["by_rows"]] == ["1-16"]
        assert rollout["by_rows"][0]["floor_bytes"] > 0  # the bytes; their seconds need CUDA
        assert "x_floor" not in rollout["by_rows"][0]
        assert max(lengths) - 1 <= rollout["decode_steps"] <= max(lengths)
    assert rows["bf16"]["step_delta_pct"] == 0.0
    want = 100 * (rows["bf16+kv-fp8"]["rollout_s"] / rows["bf16"]["rollout_s"] - 1)
    assert rows["bf16+kv-fp8"]["rollout_delta_pct"] == pytest.approx(want)
    png = tmp_path / "step.png"
    assert rl_step.main(["--plot", str(png), "--out", str(out)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out.read_text()) == data  # drawing runs nothing and writes no results


def test_rollout_parts_bins_the_decode_steps_by_live_sequences(monkeypatch):
    rl_step = load_benchmark("rl_step", monkeypatch)
    from mxrl.engine.params import GenerateStats

    stats = GenerateStats(decode_step_s=[0.004, 0.003, 0.002, 0.001, 0.001, 0.005],
                          decode_step_rows=[256, 100, 20, 16, 1, 300],
                          decode_step_keys=[256 * 4000, 100 * 3000, 20 * 2000, 16 * 1000, 500,
                                            300 * 10])  # fmt: skip
    parts = rl_step.rollout_parts(stats, rollout_s=0.1)
    assert parts["decode_s"] == pytest.approx(0.016) and parts["decode_steps"] == 6
    assert parts["other_s"] == pytest.approx(0.084)
    assert parts["by_rows"] == [
        {"rows": "1-16", "steps": 2, "s": pytest.approx(0.002), "ms_per_step": pytest.approx(1.0),
         "keys_per_row": pytest.approx((16 * 1000 + 500) / 17)},
        {"rows": "17-32", "steps": 1, "s": 0.002, "ms_per_step": 2.0, "keys_per_row": 2000.0},
        {"rows": "65-128", "steps": 1, "s": 0.003, "ms_per_step": 3.0, "keys_per_row": 3000.0},
        {"rows": "129-256", "steps": 1, "s": 0.004, "ms_per_step": 4.0, "keys_per_row": 4000.0},
        {"rows": "257-300", "steps": 1, "s": 0.005, "ms_per_step": 5.0, "keys_per_row": 10.0},
    ]  # fmt: skip
    with_floor = rl_step.rollout_parts(stats, 0.1, [4e9, 3e9, 2e9, 1e9, 1e9, 5e9], copy_gbps=2000)
    first, last = with_floor["by_rows"][0], with_floor["by_rows"][-1]
    assert first["floor_bytes"] == 2e9 and first["floor_s"] == pytest.approx(1e-3)
    assert first["x_floor"] == pytest.approx(2.0)  # 2 ms over a 1 ms floor
    assert last["floor_s"] == pytest.approx(2.5e-3) and last["x_floor"] == pytest.approx(2.0)
    bytes_only = rl_step.rollout_parts(stats, 0.1, [1.0] * 6)  # no copy rate: bytes alone
    assert bytes_only["by_rows"][0]["floor_bytes"] == 2.0
    assert "floor_s" not in bytes_only["by_rows"][0]
    empty = rl_step.rollout_parts(GenerateStats(), rollout_s=0.5)
    assert empty == {"decode_s": 0, "decode_steps": 0, "other_s": 0.5, "by_rows": []}


def test_kv_fp8_takes_the_presets_it_repeats(monkeypatch):
    rl_step = load_benchmark("rl_step", monkeypatch)
    presets = ["--presets", "bf16", "mxfp8", "fp8-block"]
    assert rl_step.parse_args([*presets, "--kv-fp8", "fp8-block"]).kv_fp8 == ["fp8-block"]
    assert rl_step.parse_args([*presets, "--kv-fp8"]).kv_fp8 == ["bf16", "mxfp8", "fp8-block"]
    assert rl_step.parse_args(presets).kv_fp8 is None
    with pytest.raises(SystemExit, match="unknown preset 'fp8-blok'"):
        rl_step.parse_args([*presets, "--kv-fp8", "fp8-blok"])


def test_the_slice_takes_a_prompt_and_the_longest_response(monkeypatch):
    """The default run (512-token prompts, responses up to 4096) fits the slice's positions:
    the engine refuses a request past `max_position_embeddings` (4096 in the layer's config)."""
    rl_step = load_benchmark("rl_step", monkeypatch)
    config = rl_step.model_config(layers=1, vocab=256, tiny=False, min_positions=512 + 4096)
    assert config.max_positions == 4608
    config.check_positions(512, 4096, "request 0", "max_new_tokens")
    assert (
        rl_step.model_config(layers=1, vocab=256, tiny=False, min_positions=100).max_positions
        == 4096
    )


def test_the_allocators_work_inside_each_sync_is_counted(tmp_path, monkeypatch):
    """`sync_phases`: the allocator's counts taken at the export and after the digest of each
    step's sync, their differences per timed step (a fake counter stands in for CUDA's)."""
    rl_step = load_benchmark("rl_step", monkeypatch)
    calls = []

    def counts(device):
        calls.append(device)
        return {"num_device_alloc": 10 * len(calls), "num_alloc_retries": len(calls) // 2}

    monkeypatch.setattr(rl_step, "allocator_counts", counts)
    out = tmp_path / "results.json"
    args = ["--tiny", "--device", "cpu", "--layers", "1", "--presets", "bf16", "--prompts", "2",
            "--samples", "2", "--prompt", "8", "--new-tokens", "24", "--steps", "2",
            "--tile", "16", "--out", str(out)]  # fmt: skip
    assert rl_step.main(args) == 0
    row = json.loads(out.read_text())["rl_step"]["rows"][0]
    assert calls == ["cpu"] * 6  # before and after each of the 3 steps' syncs
    # steps 2 and 3 (the timed ones): counts 3 -> 4 and 5 -> 6
    for phases in row["sync_phases"]:
        assert phases["num_device_alloc"] == 10 and phases["num_alloc_retries"] == 1


def test_profile_sync_profiles_an_extra_steps_own_update(tmp_path, monkeypatch, capsys):
    """--profile-sync: a step after the timed ones, its engine update profiled in place, and
    its time kept out of the rows (one timed step's row, one timed step's phases)."""
    rl_step = load_benchmark("rl_step", monkeypatch)
    out = tmp_path / "results.json"
    args = ["--tiny", "--device", "cpu", "--layers", "1", "--presets", "bf16", "--prompts", "2",
            "--samples", "2", "--prompt", "8", "--new-tokens", "24", "--steps", "1",
            "--tile", "16", "--profile-sync", "--out", str(out)]  # fmt: skip
    assert rl_step.main(args) == 0
    printed = capsys.readouterr().out
    assert "bf16 step 3:" in printed and "bf16 step 4:" not in printed
    assert "profile the loop's own update, step 3: wall" in printed
    assert "profile loop sync bf16: wall" in printed  # the rerun after the steps
    row = json.loads(out.read_text())["rl_step"]["rows"][0]
    assert len(row["per_step"]["sync_s"]) == len(row["sync_phases"]) == 1
    assert row["gc_freeze"] is True  # as mxrl train runs its steps
    assert gc.get_freeze_count() == 0  # unfrozen when the preset's steps end
    assert rl_step.parse_args(["--no-gc-freeze"]).gc_freeze is False
