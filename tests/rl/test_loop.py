"""The GRPO loop on the tiny MoE: every required metric, verified syncs, exact resume, and the
committed golden metrics of a tiny deterministic run (any change of numerics shows in review)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mxrl.rl.config import GRPOConfig
from mxrl.rl.resolve import compute_dtype_on
from mxrl.rl.resume import latest_checkpoint
from mxrl.rl.stability import SpikeDecision
from tests.rl.golden import GOLDEN, pinned_metrics
from tests.rl.loop_helpers import numerics, tiny_trainer

OLDER_LACKS = ("rng", "engine_version", "engine_digest")
REQUIRED = [
    "step",
    "reward/mean",
    "reward/std",
    "accuracy",
    "response_len/mean",
    "mismatch/k1",
    "mismatch/k3",
    "mismatch/logp_abs_diff_mean",
    "mismatch/logp_abs_diff_max",
    "loss/clip_frac",
    "grad/norm",
    "grad/spike",
    "time/rollout_s",
    "time/train_s",
    "time/sync_s",
    "time/gc_s",
    "throughput/tokens_per_s",
]


def test_every_step_logs_the_required_metrics_and_verified_syncs(tmp_path):
    trainer = tiny_trainer(tmp_path, "keys", steps=2)
    trainer.run()
    rows = trainer.record.metrics()
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, missing
        assert all(math.isfinite(row[k]) for k in REQUIRED)
    syncs = trainer.record.events("sync_verified")
    assert len(syncs) == 2 and all(e["ok"] for e in syncs)
    quant = trainer.record.events("quantization")
    assert len(quant) == 2 and set(quant[0]["sqnr_db"]) == {"layer.0", "layer.1", "layer.2"}
    assert rows[0]["grad/norm"] > 0  # the parity reward gives real gradients
    assert all(0 <= r["time/gc_s"] < r["time/rollout_s"] + r["time/train_s"] for r in rows)


def test_a_steps_gc_pauses_are_the_collections_inside_it(tmp_path, monkeypatch):
    """`time/gc_s`: the collector's pauses between the step's start and its metrics, from
    `gc.callbacks` (a collection forced inside the rollout counts; none before the step)."""
    import gc

    from mxrl.rl import metrics

    clock = metrics.GcPauses()
    monkeypatch.setattr(metrics, "GC_PAUSES", clock)
    monkeypatch.setattr("mxrl.rl.trainer.GC_PAUSES", clock)
    trainer = tiny_trainer(tmp_path, "gc", steps=1)
    generate = trainer.rollout.generate
    ticks = iter([10.0, 10.25])  # one collection of 0.25 s inside the rollout

    def collecting(*a, **k):
        monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(ticks))
        clock.callback("start", {"generation": 2})
        clock.callback("stop", {"generation": 2})
        monkeypatch.setattr(metrics.time, "perf_counter", real)
        return generate(*a, **k)

    real = metrics.time.perf_counter
    trainer.rollout.generate = collecting
    clock.seconds = 7.0  # pauses before the step are not its own
    gc.disable()  # no real collection adds to the fake one
    try:
        trainer.run()
    finally:
        gc.enable()
        gc.callbacks.remove(clock.callback)
    (row,) = trainer.record.metrics()
    assert row["time/gc_s"] == pytest.approx(0.25)


def test_resumed_run_matches_an_uninterrupted_one(tmp_path):
    full = tiny_trainer(tmp_path, "full", steps=4)
    full.run()
    first = tiny_trainer(tmp_path, "killed", steps=2, checkpoint_every=2)
    first.run()  # "killed" after step 2: only its checkpoint survives
    ckpt = latest_checkpoint(first.record.path)
    assert ckpt is not None and ckpt.name == "step_000002.pt"
    resumed = tiny_trainer(tmp_path, "resumed", steps=4)
    assert resumed.load_checkpoint(ckpt) == 2
    resumed.run()
    want = numerics(full.record.metrics())[2:]
    got = numerics(resumed.record.metrics())
    assert got == want  # sync/version included: the engine continues at the saved version

    def served(trainer):
        return [(e["step"], e["engine_digest"]) for e in trainer.record.events("sync_verified")]

    assert served(resumed) == served(full)[2:]


def test_checkpoint_from_another_plan_is_refused_and_an_older_one_loads(tmp_path, caplog):
    first = tiny_trainer(tmp_path, "a", steps=1, checkpoint_every=1)
    first.run()
    other = tiny_trainer(tmp_path, "b", recipe="mxfp8")
    with pytest.raises(ValueError, match="same recipe"):
        other.load_checkpoint(latest_checkpoint(first.record.path))
    # a checkpoint written before the RNG and engine keys: it loads, with a warning
    state = torch.load(latest_checkpoint(first.record.path), weights_only=False)
    older = tmp_path / "older.pt"
    torch.save({k: v for k, v in state.items() if k not in OLDER_LACKS}, older)
    again = tiny_trainer(tmp_path, "c", steps=1)
    assert again.load_checkpoint(older) == 1
    assert again.engine.weights_version == first.engine.weights_version == 2
    assert "may not continue bitwise" in caplog.text


def test_golden_metrics():
    """First steps of a tiny deterministic run, computed in a process pinned to one numeric
    environment (tests/golden/README.md) and compared exactly with the committed file:
    `python -m tests.rl.golden --write` rewrites it after a deliberate change of numerics."""
    got = pinned_metrics()
    want = json.loads(GOLDEN.read_text())
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    for g, w in zip(got, want, strict=True):
        for key in w:
            assert g[key] == w[key], (g["step"], key, g[key], w[key])


def test_config_validation():
    with pytest.raises(ValueError, match="samples_per_prompt"):
        GRPOConfig(samples_per_prompt=1)
    with pytest.raises(ValueError, match="correction"):
        GRPOConfig(correction="ppo")
    with pytest.raises(ValueError, match="compute_dtype"):
        GRPOConfig(compute_dtype="fp8")


def test_compute_dtype_auto_is_bf16_on_cuda_and_fp32_on_the_cpu():
    """The loop's engine and training forward: the CPU reference stays fp32 (the golden run),
    a GPU run takes the bf16 paths (CUDA-graph decode, tensor-core GEMMs) unless told not to."""
    assert compute_dtype_on(GRPOConfig().compute_dtype, "cpu") == torch.float32
    assert compute_dtype_on("auto", "cuda") == torch.bfloat16
    assert compute_dtype_on("auto", torch.device("cuda:1")) == torch.bfloat16
    assert compute_dtype_on("float32", "cuda") == torch.float32
    assert compute_dtype_on("bfloat16", "cpu") == torch.bfloat16


def test_a_skipped_spike_leaves_the_weights_and_is_recorded(tmp_path):
    trainer = tiny_trainer(tmp_path, "skip", steps=1, spike_action="skip")
    trainer.spikes.update = lambda norm: SpikeDecision(spike=True, z=42.0, skip=True)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step()
    assert metrics["grad/spike"] == 1.0 and metrics["grad/skipped"] == 1.0
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    (spike,) = trainer.record.events("spike")
    assert spike["step"] == 1 and spike["z"] == 42.0


def test_the_deep_sync_check_runs_every_n_steps_and_catches_a_corrupted_engine(tmp_path):
    """The hot path trusts the engine's own verification of what it received; every
    `verify_every` steps the engine's bytes are hashed again against a fresh export."""
    trainer = tiny_trainer(tmp_path, "deep", steps=2, verify_every=2)
    trainer.train_step()
    held = trainer.engine.weights["model.layers.0.self_attn.q_proj.weight"]
    held.view(torch.uint8)[0] ^= 1  # one flipped bit in what the engine serves
    trainer.train_step()  # the update replaces q_proj: a deep check must still see it whole
    events = trainer.record.events("sync_verified")
    assert [(e["step"], e["deep"], e["ok"]) for e in events] == [(1, False, True), (2, True, True)]
    broken = trainer.engine.weights["model.layers.0.self_attn.q_proj.weight"]
    broken.view(torch.uint8)[0] ^= 1
    assert not trainer._verify_sync()  # memory corrupted after the load: the deep check says so
    with pytest.raises(ValueError, match="verify_every"):
        GRPOConfig(verify_every=-1)


def test_the_in_process_export_is_one_bucket_with_one_host_read(tmp_path, monkeypatch):
    """The single-process actor exports for the engine beside it in one bucket (WHOLE_UPDATE):
    one host read of the checksums per sync instead of one per 512 MiB bucket (each stalls the
    device between buckets), the engine holding every record until it loads them anyway."""
    from mxrl.weights import WHOLE_UPDATE, buckets

    trainer = tiny_trainer(tmp_path, "one-bucket", steps=1)
    reads = []
    real = buckets.PendingChecksums.wait

    def wait(self):
        sums = real(self)
        reads.append(len(sums))
        return sums

    monkeypatch.setattr(buckets.PendingChecksums, "wait", wait)
    update = trainer.actor.export(1, sqnr=False)
    assert update.bucket_bytes == WHOLE_UPDATE
    parts = list(update)
    assert len(parts) == 1 and parts[0].last
    assert reads == [len(trainer.plan)]  # every tensor's checksum in one read
    monkeypatch.undo()
    # the same weights at a small bucket size split: the tiny model is not one bucket by size
    small = buckets.export(trainer.model, trainer.plan, bucket_bytes=2**16, step=1, sqnr=False)
    assert len(list(small)) > 1


def test_run_keeps_the_set_ups_objects_out_of_the_collectors_walks(tmp_path, monkeypatch):
    """`run()` freezes the heap it starts with (gc.freeze: a full collection walks every
    tracked object, ~300k after the imports) for its steps and unfreezes it when it ends, also
    when a step fails."""
    import gc

    trainer = tiny_trainer(tmp_path, "frozen", steps=2)
    assert gc.get_freeze_count() == 0
    step, seen = trainer.train_step, []

    def watched():
        seen.append(gc.get_freeze_count())
        return step()

    monkeypatch.setattr(trainer, "train_step", watched)
    trainer.run()
    assert len(seen) == 2 and min(seen) > 1000  # the modules, the model, the engine
    assert gc.get_freeze_count() == 0

    failing = tiny_trainer(tmp_path, "frozen-fails", steps=2)
    monkeypatch.setattr(failing, "train_step", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.run()
    assert gc.get_freeze_count() == 0
