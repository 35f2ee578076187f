"""mxrl.rl.metrics on its own: a step's metrics from hand-computed values, the collector's clock,
the frozen heap, the CPU's memory peak against the kernel's own counter, and the progress line."""

from __future__ import annotations

import gc
import logging
import weakref
from pathlib import Path

import pytest
import torch

from mxrl.engine import Completion
from mxrl.rl import metrics
from mxrl.rl.metrics import GcPauses, Progress, format_eta, frozen_heap, settle, step_metrics


def completion(prompt: int, tokens: int) -> Completion:
    return Completion(prompt=[1] * prompt, tokens=[2] * tokens, logprobs=torch.zeros(tokens))


def test_step_metrics_from_hand_computed_values():
    outs = [completion(3, 2), completion(4, 5), completion(1, 1)]  # 16 tokens in all
    rewards = torch.tensor([1.0, 0.5, 0.0])  # 0.5 is not a success: accuracy counts > 0.5
    mask = torch.tensor([[1.0, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    stats = {"loss/clip_frac": 0.25, "loss/pg": -0.5, "tis/mean_weight": 0.9, "other": 7.0}
    m = step_metrics(
        outs, rewards, mask, {"mismatch/k3": 1e-3}, stats, grad_norm=2.5,
        decision={"spike/skipped": 0.0}, times=(1.5, 2.5, 0.25), elapsed=4.0, version=3,
    )  # fmt: skip
    assert m == {
        "reward/mean": 0.5,
        "reward/std": 0.5,  # sample std of (1, 0.5, 0): sqrt(0.5 / 2)
        "accuracy": pytest.approx(1 / 3),
        "response_len/mean": pytest.approx(8 / 3),
        "mismatch/k3": 1e-3,
        "loss/clip_frac": 0.25,
        "loss/pg": -0.5,
        "grad/norm": 2.5,
        "spike/skipped": 0.0,
        "time/rollout_s": 1.5,
        "time/train_s": 2.5,
        "time/sync_s": 0.25,
        "throughput/tokens_per_s": 4.0,  # 16 tokens (prompts and completions) in 4 s
        "sync/version": 3.0,
        "tis/mean_weight": 0.9,  # what the loss reported of TIS / MIS, and nothing else of it
    }
    one = step_metrics(
        outs[:1], rewards[:1], mask[:1], {}, stats, 0.0, {}, (0.0, 0.0, 0.0), 1.0, 0
    )  # fmt: skip
    assert one["reward/std"] == 0.0  # one sample has no spread (torch's std would be NaN)
    assert "tis/clipped_frac" not in one and "mis/masked_frac" not in one
    corrected = {**stats, "tis/clipped_frac": 0.125, "mis/masked_frac": 0.0625}
    two = step_metrics(
        outs[:2], rewards[:2], mask[:2], {}, corrected, 0.0, {}, (0.0, 0.0, 0.0), 1.0, 0
    )  # fmt: skip
    assert two["reward/std"] == pytest.approx(0.5**0.5 / 2)  # (1, 0.5): sqrt(0.125 / 1)
    assert two["tis/clipped_frac"] == 0.125 and two["mis/masked_frac"] == 0.0625


def test_gc_pauses_adds_each_collection_by_generation(monkeypatch):
    clock = iter([10.0, 10.25, 20.0, 20.5, 30.0, 30.125])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    pauses = GcPauses()
    for generation in (0, 2, 0):
        pauses.callback("start", {"generation": generation})
        pauses.callback("stop", {"generation": generation})
    assert pauses.seconds == 0.875 and pauses.collections == 3
    assert pauses.by_generation == {0: [2, 0.375], 2: [1, 0.5]}


def test_gc_pauses_installs_its_callback_once():
    pauses = GcPauses()
    try:
        assert pauses.install() is pauses and pauses.install() is pauses
        assert gc.callbacks.count(pauses.callback) == 1
        before = pauses.collections
        gc.collect()
        assert pauses.collections == before + 1 and pauses.by_generation[2][0] >= 1
    finally:
        while pauses.callback in gc.callbacks:
            gc.callbacks.remove(pauses.callback)


def test_frozen_heap_freezes_what_lives_on_entry_and_only_that():
    class Held:
        pass

    alive_on_entry = Held()
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        made_inside = Held()
        made_inside.cycle = made_inside
        gone = weakref.ref(made_inside)
        del made_inside
        gc.collect()  # cyclic garbage made during the run is still collected
        assert gone() is None and gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0 and alive_on_entry is not None


def test_a_run_frees_its_predecessors_cyclic_garbage_before_freezing_the_heap():
    """The ablation runs its presets one after another in one process: the previous run's
    model, engine and optimizer (device memory) are garbage in reference cycles that sit in the
    collector's oldest generation once its frozen heap thaws. Frozen with the next run's heap
    they would hold that memory through the whole run (on the H100 the second preset of
    benchmarks/rl_step.py ran out of memory so); `frozen_heap` collects in full first."""

    class Holder:  # stands for the previous run's trainer
        pass

    held = Holder()
    held.cycle = held  # a reference cycle: only the collector frees it
    alive = weakref.ref(held)
    gc.freeze()  # the previous run's frozen heap ...
    gc.unfreeze()  # ... thawed into the oldest generation
    del held
    assert alive() is not None  # garbage the young collections do not reach
    with frozen_heap():
        assert alive() is None


def test_memory_peak_on_the_cpu_is_the_peak_resident_set_in_gib():
    """Linux's getrusage gives ru_maxrss in KiB (the CPU's `memory/*_peak_gib`: GiB)."""
    import resource

    if not Path("/proc/self/status").exists():
        pytest.skip("ru_maxrss is KiB on Linux (bytes on macOS)")

    def maxrss_gib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    before = maxrss_gib()
    peak = metrics.memory_peak("cpu")
    assert before <= peak <= maxrss_gib()
    assert 0.01 < peak < 64  # a process with torch loaded: tens of MiB to a few GiB


def test_memory_peak_and_settle_on_cuda_ask_the_device_they_are_given(monkeypatch):
    """The CUDA branches, without a GPU: the allocator's peak of that device in GiB, then its
    counter reset (the next stage's peak is its own); `settle` waits for that device."""
    calls = []
    monkeypatch.setattr(
        torch.cuda, "max_memory_allocated", lambda d: calls.append(("max", d)) or 3 * 2**29
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: calls.append(("sync", d)))
    assert metrics.memory_peak("cuda:1") == 1.5
    settle(torch.device("cuda", 1))
    one = torch.device("cuda", 1)
    assert calls == [("max", one), ("reset", one), ("sync", one)]
    calls.clear()
    settle("cpu")  # nothing to wait for on the CPU
    assert calls == []


def test_progress_line_names_the_step_its_time_and_what_is_left(monkeypatch, caplog):
    clock = iter([100.0, 130.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    progress = Progress(start_step=2, steps=12)
    m = {"reward/mean": 0.4567, "accuracy": 0.5, "mismatch/k3": 1.5e-3, "grad/norm": 0.25,
         "time/rollout_s": 1.0, "time/train_s": 0.5, "time/sync_s": 0.25}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="mxrl.rl.metrics"):
        progress.log(5, m)  # 3 steps in 30 s: 10 s a step, 7 steps left
    assert caplog.messages == [
        "step 5/12 reward 0.457 acc 0.50 k3 1.50e-03 grad 0.250 (1.8s) ETA 1m10s"
    ]


def test_progress_before_a_step_is_done_takes_the_time_so_far_as_one_step(monkeypatch, caplog):
    clock = iter([100.0, 104.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    progress = Progress(start_step=5, steps=10)
    m = {"reward/mean": 0.0, "accuracy": 0.0, "mismatch/k3": 0.0, "grad/norm": 0.0,
         "time/rollout_s": 0.0, "time/train_s": 0.0, "time/sync_s": 0.0}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="mxrl.rl.metrics"):
        progress.log(5, m)  # no step done since the start: 4 s as one step, 5 left
    assert caplog.messages[0].endswith("ETA 20s")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(-3.0, "0s"), (0.4, "0s"), (59.4, "59s"), (59.6, "1m00s"), (61.0, "1m01s"),
     (3599.4, "59m59s"), (3600.0, "1h00m"), (7140.0, "1h59m"), (7261.0, "2h01m")],
)  # fmt: skip
def test_format_eta_edges(seconds, text):
    assert format_eta(seconds) == text
