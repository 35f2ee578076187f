"""`mxrl convert --model runs/<id>`: a trained policy leaves mxrl with the bytes the run's engine
held, or is refused with nothing written (mxrl/app/policy.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from mxrl.cli import main
from mxrl.engine import Engine
from mxrl.weights.digest import weights_digest


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 1-step run of the built-in tiny model under mxfp8, checkpointed at step 1."""
    tmp = tmp_path_factory.mktemp("policy")
    cfg = {
        "model": "builtin:tiny-moe",
        "data": {"source": "builtin:arithmetic", "warmup_steps": 5},
        "out": str(tmp / "runs"),
        "run_id": "r",
        "rl": {"recipe": "mxfp8", "prompts_per_step": 2, "samples_per_prompt": 2, "steps": 1,
               "checkpoint_every": 1},
    }  # fmt: skip
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MXRL_CACHE", str(tmp / "cache"))
        assert main(["train", "--config", str(tmp / "c.yaml")]) == 0
    return tmp / "runs" / "r"


def test_the_default_export_loads_in_the_engine_with_the_runs_digest(run, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["convert", "--model", str(run), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step 1 (checkpoint step_000001.pt)" in text
    assert "the bytes are the engine's after step 1" in text
    state = torch.load(run / "checkpoints" / "step_000001.pt", weights_only=False)
    engine = Engine.from_checkpoint(out)
    assert weights_digest(engine.hashes.items()) == state["engine_digest"]
    assert json.loads((out / "manifest.json").read_text())["plan_hash"] == state["plan_hash"]


def test_another_recipe_exports_and_says_it_was_not_rolled_out(run, tmp_path, capsys):
    out = tmp_path / "served"
    args = ["convert", "--model", str(run), "--out", str(out), "--to", "hf", "--recipe", "bf16"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "a plan other than the run's" in text
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_a_checkpoint_whose_weights_changed_is_refused_and_nothing_is_written(
    run, tmp_path, capsys
):
    copy = tmp_path / "r"
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / "step_000001.pt"
    state = torch.load(ckpt, weights_only=False)
    state["model"]["model.layers.0.self_attn.q_proj.weight"][0, 0] += 1.0  # not the served one
    torch.save(state, ckpt)
    out = tmp_path / "out"
    assert main(["convert", "--model", str(copy), "--out", str(out), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mxrl: error:") and "is not the engine's" in err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_run_without_checkpoints_is_refused(run, tmp_path, capsys):
    copy = tmp_path / "r"
    shutil.copytree(run, copy)
    (copy / "checkpoints" / "step_000001.pt").unlink()
    assert main(["convert", "--model", str(copy), "--out", str(tmp_path / "o")]) == 2
    assert "has no checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_hf_directory_needs_a_recipe(tmp_path, capsys):
    assert main(["convert", "--model", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "--recipe is required" in capsys.readouterr().err
