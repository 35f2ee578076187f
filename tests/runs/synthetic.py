"""Synthetic runs for the tests: rising reward, mismatch, a spike, syncs, quantization events."""

from __future__ import annotations

import json

from mxrl.runs import RunRecord
from mxrl.weights import QuantizationEvent


def write_run(
    root,
    run_id: str,
    recipe: str | None = "nvfp4-dequantized",
    *,
    steps: int = 30,
    spike_at: int | None = 12,
    sync_fail_at: int | None = None,
    start_time: str | None = None,
    keys: tuple[str, ...] | None = None,
) -> RunRecord:
    config = {"recipe": recipe, "lr": 1e-6, "grpo": {"group_size": 8}} if recipe else {"lr": 1e-6}
    rec = RunRecord.create(
        root, run_id, config=config, plan_json='{"hash": "h0"}', backend="reference"
    )
    for s in range(steps):
        spike = 1.0 if s == spike_at else 0.0
        row = {
            "reward/mean": 0.1 + 0.02 * s,
            "reward/std": 0.05,
            "accuracy": 0.01 * s,
            "response_len/mean": 100.0 + s,
            "mismatch/k1": 1e-4,
            "mismatch/k3": 2e-4 * (1 + s / steps),
            "mismatch/logp_abs_diff_mean": 0.01,
            "mismatch/logp_abs_diff_max": 0.5 + s / 100,
            "loss/clip_frac": 0.02,
            "grad/norm": 1.0 + 20.0 * spike,
            "grad/spike": spike,
            "time/rollout_s": 1.0,
            "time/train_s": 0.5,
            "time/sync_s": 0.1,
            "throughput/tokens_per_s": 1234.0,
        }
        if s % 10 == 0 or s == steps - 1:  # held-out accuracy every few steps, as the loop
            row["eval/accuracy"] = 0.3 + 0.01 * s
        if keys is not None:
            row = {k: v for k, v in row.items() if k in keys}
        rec.log_metrics(s, row)
        rec.log_quantization(
            QuantizationEvent(s, "h0", 12, 4096, 0.01, {"layer.0": 20.5, "layer.1": 19.5})
        )
        rec.log_sync_verified(s, version=s + 1, plan_hash="h0", ok=s != sync_fail_at)
    if spike_at is not None:
        rec.log_spike(spike_at, 21.0, 7.5, {"model.layers.1.mlp": 18.0, "lm_head": 2.0})
    if start_time is not None:
        env = rec.env
        env["start_time"] = start_time
        (rec.path / "env.json").write_text(json.dumps(env))
    rec.finish(steps - 1)
    return rec


def strict_json(line: str):
    """json.loads that refuses NaN/Infinity (non-standard JSON)."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=refuse)
