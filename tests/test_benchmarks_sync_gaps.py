"""benchmarks/sync_gaps.py: the idle-gap attribution on hand-made events, and the script shrunk
on the CPU (every annotated step still exists in mxrl: a rename fails here, not on a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _event(name, start, end, device):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                           device_type=device)  # fmt: skip


def test_each_gap_goes_to_the_innermost_host_range_at_its_midpoint(monkeypatch):
    """Times in us: the sync from 0 to 5000, a step @A from 1500 to 3500, device ops at
    1000-2000 and 3000-4000 (and one before the sync, not counted). The first gap (0-1000,
    midpoint 500) is the sync's own, the second (2000-3000, midpoint 2500) @A's: 1 ms each;
    2 ms busy; the first op 1 ms in."""
    gaps = load_benchmark("sync_gaps", monkeypatch)
    events = [
        _event("@sync", 0, 5000, CPU), _event("@A", 1500, 3500, CPU),
        _event("kernel", -500, -100, CUDA), _event("kernel", 1000, 2000, CUDA),
        _event("kernel", 3000, 4000, CUDA), _event("aten::copy_", 2000, 2100, CPU),
    ]  # fmt: skip
    first, busy, idle = gaps.idle_gaps(events)
    assert (first, busy, idle) == (1.0, 2.0, {"@sync": 1.0, "@A": 1.0})


def test_overlapping_device_ops_count_once(monkeypatch):
    """Two streams' ops overlapping (1000-3000 and 2000-2500) are 2 ms busy, no gap between."""
    gaps = load_benchmark("sync_gaps", monkeypatch)
    events = [_event("@sync", 1000, 4000, CPU), _event("k", 1000, 3000, CUDA),
              _event("k", 2000, 2500, CUDA)]  # fmt: skip
    assert gaps.idle_gaps(events) == (0.0, 2.0, {})


def test_the_script_runs_on_the_cpu(monkeypatch, capsys):
    """--tiny, one layer, two presets: a line per preset (no device ops on the CPU: busy 0),
    and every ANNOTATED step found in this tree (strict)."""
    gaps = load_benchmark("sync_gaps", monkeypatch)
    argv = ["--tiny", "--layers", "1", "--presets", "bf16", "mxfp8", "--repeats", "1"]
    assert gaps.main(argv, patch=monkeypatch.setattr) == 0
    out = capsys.readouterr().out
    assert "not in this tree" not in out
    for preset in ("bf16", "mxfp8"):
        assert f"{preset}: " in out and "device busy 0.00 ms" in out


def test_another_tree_may_lack_a_module_or_a_step(monkeypatch):
    """--tree runs an older checkout: a step or a whole module it lacks is left unannotated
    (the A/B of session 25 lost its base runs to a module the old tree did not have)."""
    gaps = load_benchmark("sync_gaps", monkeypatch)
    monkeypatch.setattr(
        gaps, "ANNOTATED", (*gaps.ANNOTATED, ("mxrl.no_such_module", "f"), ("mxrl.weights", "nope"))
    )
    missing = gaps.annotate(strict=False, patch=monkeypatch.setattr)
    assert missing == ["mxrl.no_such_module.f", "nope"]
    with pytest.raises(ModuleNotFoundError):
        gaps.annotate(strict=True, patch=monkeypatch.setattr)


def test_device_ops_sum_each_name_longest_first(monkeypatch):
    """Times in us: two `a` ops (1 ms and 2 ms) and one `b` (2.5 ms); host events not counted."""
    gaps = load_benchmark("sync_gaps", monkeypatch)
    events = [_event("a", 0, 1000, CUDA), _event("b", 0, 2500, CUDA),
              _event("a", 5000, 7000, CUDA), _event("a", 0, 9000, CPU)]  # fmt: skip
    assert gaps.device_ops(events) == [("a", 3.0, 2), ("b", 2.5, 1)]


def test_the_sampled_sync_profiles_on_the_cpu(monkeypatch, capsys):
    """--profile-sampled --kernels 3 on the CPU: the run completes (no device ops to list)."""
    gaps = load_benchmark("sync_gaps", monkeypatch)
    argv = ["--tiny", "--layers", "1", "--presets", "fp8-block", "--repeats", "1",
            "--profile-sampled", "--kernels", "3"]  # fmt: skip
    assert gaps.main(argv, patch=monkeypatch.setattr) == 0
    assert "fp8-block: " in capsys.readouterr().out
