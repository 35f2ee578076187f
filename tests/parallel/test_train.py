"""`torchrun --nproc-per-node 2 mxrl train` on two CPU processes (gloo), with a placement section.

- split (1 train rank + 1 rollout rank): every metric but timings, and the engine digest of
  every sync, equal the single-process run of the same config, bit for bit (the train rank's
  FSDP2 mesh has one rank; the rollout rank gets the weights over torch.distributed);
- colocated (both ranks train their half of the batch on FSDP2 shards and serve rollouts): a
  run resumed from its distributed checkpoint (DCP) at step 2 in fresh processes ends exactly
  where the uninterrupted run ends: metrics, syncs, and the step-4 checkpoint's every tensor;
- held-out evaluation (`eval_every`) on every placement: each serving rank decodes its share.

Every run evaluates (steps 0, 2, 4), so one set of launches shows all of it: the evaluation
runs before the step's checkpoint and draws from no RNG the training uses, and the comparisons
above cover its rows too (the resumed run's step-4 evaluation included).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mxrl.parallel import Placement
from mxrl.parallel.shares import share
from mxrl.rl.resume import CHECKPOINT_DIR
from mxrl.runs import RunRecord
from tests.numeric_env import run_python
from tests.numerics import assert_bytes_equal
from tests.parallel.helpers import tail, torchrun
from tests.rl.loop_helpers import numerics

STEPS, EVERY = 4, 2
RL = {
    "recipe": "nvfp4-dequantized", "steps": STEPS, "checkpoint_every": EVERY, "verify_every": 2,
    "prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 8, "engine_tile": 16,
    "lr": 3e-3, "seed": 0, "eval_every": EVERY,
    # ~15 tokens a sequence: 2 per micro-batch, so a train rank runs several (8 on one rank, 4
    # on each of two: the ranks agree on the count) and the gradients accumulate over them
    "max_tokens_per_micro_batch": 40,
}  # fmt: skip
EVALS = [0, 2, 4]  # the starting policy (a row of its own: eval/accuracy only), then every 2


def _config(tmp: Path, name: str, **top) -> Path:
    data = {
        "model": "builtin:tiny-moe",
        # 60 warm-up steps: a model that sometimes earns the reward (non-zero gradients)
        "data": {"source": "builtin:arithmetic", "warmup_steps": 60},
        "out": str(tmp / "runs"),
        "rl": RL,
        **top,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _syncs(record: RunRecord) -> list[tuple]:
    return [
        (e["step"], e["version"], e["ok"], e["engine_digest"], e["deep"])
        for e in record.events("sync_verified")
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dist_train")
    env = {"MXRL_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}
    single = run_python(
        ["-m", "mxrl.cli", "train", "--config", str(_config(tmp, "single", run_id="single"))],
        env, timeout=300,
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-4000:]
    launches = [
        _config(tmp, "split", run_id="split", placement={"mode": "split", "train_ranks": 1,
                                                         "rollout_ranks": 1}),
        _config(tmp, "colocated", run_id="colocated", placement={"mode": "colocated"}),
    ]  # fmt: skip
    for config in launches:
        out = torchrun(["-m", "mxrl.cli", "train", "--config", str(config)], env=env)
        assert out.returncode == 0, tail(out)
    # the run killed after its step-2 checkpoint: a copy without the later one, resumed
    shutil.copytree(tmp / "runs" / "colocated", tmp / "runs" / "resumed")
    shutil.rmtree(tmp / "runs" / "resumed" / CHECKPOINT_DIR / f"step_{STEPS:06d}")
    resume = _config(
        tmp, "resume", resume=str(tmp / "runs" / "resumed"), placement={"mode": "colocated"}
    )
    out = torchrun(["-m", "mxrl.cli", "train", "--config", str(resume)], env=env)
    assert out.returncode == 0, tail(out)
    return tmp / "runs"


def test_split_placement_is_the_single_process_run_bit_for_bit(runs):
    single, split = RunRecord.open(runs / "single"), RunRecord.open(runs / "split")
    want = numerics(single.metrics())
    assert [r["step"] for r in want] == list(range(0, STEPS + 1))
    assert numerics(split.metrics()) == want  # the evaluations too
    assert sorted(_evals(split)) == EVALS
    assert _syncs(split) == _syncs(single)
    assert any(r["grad/norm"] > 0 for r in want[1:]), "no step had a gradient: vacuous"
    # per-rank timings, written once by rank 0
    row = split.metrics()[1]
    assert {"time/rank0/train_s", "time/rank1/rollout_s", "time/rank1/sync_s"} <= row.keys()
    assert (runs / "split" / "config.yaml").exists()


def test_colocated_resume_from_a_distributed_checkpoint_is_exact(runs):
    full, resumed = RunRecord.open(runs / "colocated"), RunRecord.open(runs / "resumed")
    (event,) = resumed.events("resume")
    assert event["from_step"] == EVERY
    want = numerics(full.metrics())
    assert [r["step"] for r in want] == list(range(0, STEPS + 1))
    assert numerics(resumed.metrics()) == want  # step 4's evaluation ran in the resumed processes
    assert sorted(_evals(resumed)) == EVALS
    assert _syncs(resumed) == _syncs(full)
    assert all(s[2] for s in _syncs(full)) and any(s[4] for s in _syncs(full))  # deep checks
    served = {s[3] for s in _syncs(full) if s[0] > EVERY}
    assert len(served) > 1, "the weights did not change after the resume point"
    name = f"step_{STEPS:06d}"
    states = []
    for run in ("colocated", "resumed"):
        ckpt = runs / run / CHECKPOINT_DIR / name
        assert {"trainer.pt", "rng_rank0.pt", "rng_rank1.pt", ".metadata"} <= {
            p.name for p in ckpt.iterdir()
        }
        dcp_to_torch_save(ckpt, runs / f"{run}.pt")
        states.append(torch.load(runs / f"{run}.pt", weights_only=False))
    got, want_state = states
    assert _flat(got).keys() == _flat(want_state).keys()
    for key, value in _flat(want_state).items():
        other = _flat(got)[key]
        if isinstance(value, torch.Tensor):
            assert_bytes_equal(other, value, key)
        else:
            assert other == value, key


def test_colocated_run_trains_on_both_ranks_and_stays_close_to_single_process(runs):
    # two ranks sum their halves of the batch in another order: close, not bitwise
    single = numerics(RunRecord.open(runs / "single").metrics())
    coloc = numerics(RunRecord.open(runs / "colocated").metrics())
    assert coloc[1]["grad/norm"] == pytest.approx(single[1]["grad/norm"], rel=1e-4)
    # the loss stats of both ranks' micro-batches add up to the batch's (a sum that cancels to
    # ~1e-2: its rounding is the bound), and both ranks' tokens are counted
    assert coloc[1]["loss/pg"] == pytest.approx(single[1]["loss/pg"], abs=1e-6)
    assert coloc[1]["loss/clip_frac"] == single[1]["loss/clip_frac"]
    assert coloc[1]["reward/mean"] == single[1]["reward/mean"]  # step 1: the same weights
    assert {"time/rank0/rollout_s", "time/rank1/rollout_s"} <= RunRecord.open(
        runs / "colocated"
    ).metrics()[1].keys()


def test_a_runs_policy_leaves_as_the_engine_held_it(runs, tmp_path, capsys):
    """`mxrl convert --model runs/<id>` on the single-process run (.pt) and the colocated one
    (DCP, written by two FSDP2 ranks): each export's digest is the one the run's engine
    recorded after the last step, checked before the folder is in place; the split run trained
    bit for bit as the single one, so their served files are the same bytes."""
    from mxrl.cli import main

    files = {}
    for run in ("single", "split", "colocated"):
        out = tmp_path / run
        code = main(["convert", "--model", str(runs / run), "--out", str(out), "--to", "hf"])
        text = capsys.readouterr().out
        assert code == 0, text
        assert f"the bytes are the engine's after step {STEPS}" in text
        assert ("DCP folder" in text) == (run != "single")
        files[run] = (out / "model.safetensors").read_bytes()
    assert files["split"] == files["single"]
    # the colocated run sums its ranks' halves of the batch in another order: whether that
    # rounding moves a served byte (a bf16 rounding or a quantized code) depends on the CPU, so
    # its file is the single run's exactly when its engine recorded the same digest
    syncs = {run: _syncs(RunRecord.open(runs / run)) for run in ("single", "colocated")}
    last = {run: s[-1][3] for run, s in syncs.items()}
    assert (files["colocated"] == files["single"]) == (last["colocated"] == last["single"])
    # not vacuous: the served bytes changed over each run, so a file shows which step it holds
    for run, s in syncs.items():
        assert len({e[3] for e in s}) > 1, run


def _evals(record: RunRecord) -> dict[int, float]:
    return {r["step"]: r["eval/accuracy"] for r in record.metrics() if "eval/accuracy" in r}


def test_held_out_evaluation_runs_on_every_placement(runs):
    # the rows of the runs above (split and resumed: their bitwise comparisons include them)
    single = _evals(RunRecord.open(runs / "single"))
    assert sorted(single) == EVALS
    # split: the one-process run bit for bit, its evaluations too
    assert _evals(RunRecord.open(runs / "split")) == single
    # colocated: both ranks decode their half of the eval set; at step 0 (the same weights)
    # the accuracy is the one-process run's, later ones follow weights that are close only
    coloc = _evals(RunRecord.open(runs / "colocated"))
    assert sorted(coloc) == EVALS and coloc[0] == single[0]


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


# --- no processes ------------------------------------------------------------------------------
def test_placement_checks_name_the_field_and_the_fix():
    assert Placement.from_dict({"mode": "split", "train_ranks": 1, "rollout_ranks": 1}).ranks(
        2
    ) == ([0], [1])
    assert Placement().ranks(2) == ([0, 1], [0, 1])
    with pytest.raises(ValueError, match="WORLD_SIZE 3"):
        Placement(mode="split", train_ranks=1, rollout_ranks=1).ranks(3)
    with pytest.raises(ValueError, match="needs train_ranks and rollout_ranks"):
        Placement(mode="split")
    with pytest.raises(ValueError, match="colocated placement uses every rank"):
        Placement(train_ranks=1).ranks(2)
    with pytest.raises(ValueError, match="unknown key"):
        Placement.from_dict({"gpus": 2})
    with pytest.raises(ValueError, match="mode"):
        Placement(mode="pipelined")


def test_shares_are_contiguous_whole_and_in_rank_order():
    for n, parts in [(4, 2), (5, 2), (7, 3), (3, 3)]:
        shares = [share(n, parts, p) for p in range(parts)]
        assert [i for s in shares for i in s] == list(range(n))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_train_refuses_a_torchrun_launch_without_placement(tmp_path, monkeypatch):
    from mxrl.app.train import run_train

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="no placement section"):
        run_train(_config(tmp_path, "x"))
