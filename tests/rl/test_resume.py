"""Resume is bitwise across processes: `mxrl train` killed with SIGKILL after a checkpoint and
resumed in a fresh process ends exactly where the uninterrupted run ends.

Three processes share one warm-up cache (the uninterrupted run pays for the warm-up, the others
load it): (a) the uninterrupted run; (b) the same config, killed with SIGKILL once its step-2
checkpoint exists (it may be a step or two further by then: any checkpoint it left is a valid
resume point); (c) a fresh process resuming (b)'s run directory. Then, byte for byte: every
checkpoint both runs hold (weights, optimizer, data stream, spike detector, RNGs, engine
version and digest), the engine digest of every step's sync, and every metric but timings.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from mxrl.rl.resume import CHECKPOINT_DIR, latest_checkpoint
from mxrl.runs import RunRecord
from tests.numeric_env import REPO, run_python
from tests.numerics import assert_bytes_equal
from tests.rl.loop_helpers import numerics

pytestmark = pytest.mark.capability

STEPS, EVERY = 6, 2
# 60 warm-up steps: a model that sometimes earns the reward, so some steps have non-zero
# advantages and the weights and Adam moments move (checked below: not a vacuous comparison).
RL = {
    "recipe": "nvfp4-dequantized",
    "steps": STEPS,
    "checkpoint_every": EVERY,
    "prompts_per_step": 4,
    "samples_per_prompt": 4,
    "max_new_tokens": 8,
    "engine_tile": 16,
    "lr": 3e-3,
    "seed": 0,
}


def _write_config(tmp: Path, name: str, **top: Any) -> Path:
    data = {
        "model": "builtin:tiny-moe",
        "data": {"source": "builtin:arithmetic", "warmup_steps": 60},
        "out": str(tmp / "runs"),
        "rl": RL,
        **top,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _train(config: Path, env: dict[str, str]) -> None:
    out = run_python(["-m", "mxrl.cli", "train", "--config", str(config)], env, timeout=300)
    assert out.returncode == 0, f"mxrl train {config.name} failed:\n{out.stderr[-4000:]}"


def _kill_after_first_checkpoint(config: Path, run_dir: Path, env: dict[str, str]) -> None:
    """Start `mxrl train`, SIGKILL it as soon as checkpoints/step_000002.pt exists (the file
    appears by an atomic rename, so it is whole)."""
    first = run_dir / CHECKPOINT_DIR / f"step_{EVERY:06d}.pt"
    with open(config.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mxrl.cli", "train", "--config", str(config)],
            cwd=REPO, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        try:
            while not first.exists():
                assert proc.poll() is None, (
                    f"the run to kill exited ({proc.returncode}) before its first checkpoint:\n"
                    + config.with_suffix(".log").read_text()[-4000:]
                )
                assert time.monotonic() < deadline, "no checkpoint after 300 s"
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"it ended by itself ({proc.returncode})"


def _assert_same(got: Any, want: Any, where: str) -> None:
    """Equal bytes for tensors and floats, equal values for everything else, recursively."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert_bytes_equal(got, want, where)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, sorted(got))
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, float), where
        assert struct.pack("<d", got) == struct.pack("<d", want), (where, got, want)
    else:
        assert got == want, (where, got, want)


def _syncs(record: RunRecord) -> list[tuple]:
    return [
        (e["step"], e["version"], e["ok"], e["engine_digest"])
        for e in record.events("sync_verified")
    ]


def test_sigkilled_run_resumed_in_a_fresh_process_is_bitwise_the_uninterrupted_one(tmp_path):
    # MXRL_CACHE: the warm-up runs once (in a); one thread: tiny tensors, two cores in CI
    env = {"MXRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    runs = tmp_path / "runs"
    _train(_write_config(tmp_path, "a", run_id="full"), env)
    _kill_after_first_checkpoint(
        _write_config(tmp_path, "b", run_id="killed"), runs / "killed", env
    )
    resume_point = latest_checkpoint(runs / "killed")
    assert resume_point is not None and resume_point.name < f"step_{STEPS:06d}.pt"
    _train(_write_config(tmp_path, "c", resume=str(runs / "killed")), env)

    full, resumed = RunRecord.open(runs / "full"), RunRecord.open(runs / "killed")
    want_ckpts = sorted(p.name for p in (runs / "full" / CHECKPOINT_DIR).glob("*.pt"))
    assert want_ckpts == [f"step_{s:06d}.pt" for s in range(EVERY, STEPS + 1, EVERY)]
    got_ckpts = sorted(p.name for p in (runs / "killed" / CHECKPOINT_DIR).glob("*.pt"))
    assert got_ckpts == want_ckpts
    for name in want_ckpts:  # the last one from (c), the ones before from (b) or (c)
        got, want = (
            torch.load(r.path / CHECKPOINT_DIR / name, map_location="cpu", weights_only=False)
            for r in (resumed, full)
        )
        assert {"model", "opt", "rng", "source", "spikes", "engine_digest"} <= want.keys()
        _assert_same(got, want, name)

    (resume,) = resumed.events("resume")
    assert f"step_{resume['from_step']:06d}.pt" == resume_point.name
    steps = list(range(1, STEPS + 1))
    want_syncs = _syncs(full)
    assert [s[0] for s in want_syncs] == steps and all(s[2] for s in want_syncs)
    assert [s[1] for s in want_syncs] == [s + 1 for s in steps]  # one load at build, one a step
    assert _syncs(resumed) == want_syncs

    want = numerics(full.metrics())
    assert [r["step"] for r in want] == steps and "sync/version" in want[0]
    assert numerics(resumed.metrics()) == want
    # not vacuous: some step had a gradient (Adam's moments are non-zero from then on), and the
    # weights the engine served kept changing after the resume point
    assert any(r["grad/norm"] > 0 for r in want), "no step had a gradient"
    served = {s[3] for s in want_syncs if s[0] >= resume["from_step"]}
    assert len(served) > 1, "the weights did not change after the resume point"
