"""`mxrl train --config` end to end, shrunk to seconds; the dataset source (the demo:
tests/app/test_demo.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mxrl.app.data import PromptDataset
from mxrl.app.rewards import load_reward
from mxrl.app.sources import DatasetSource
from mxrl.arch import builtin_config
from mxrl.cli import main
from mxrl.models import CharTokenizer, build_model
from mxrl.rl.trainer import GRPOTrainer
from mxrl.runs import RunRecord
from tests.rl.loop_helpers import tiny_config


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MXRL_CACHE", str(tmp_path / "cache"))


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def _tiny_train(tmp_path: Path, run_id: str | None, recipe: str, **rl) -> Path:
    """A `mxrl train` config on the built-in tiny model (5 warm-up steps), 2 steps by default."""
    data = {
        "model": "builtin:tiny-moe",
        "data": {"source": "builtin:arithmetic", "warmup_steps": 5},
        "out": str(tmp_path / "runs"),
        "rl": {"recipe": recipe, "steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2, **rl},
    }
    if run_id is not None:
        data["run_id"] = run_id
    return _write(tmp_path / "train.yaml", data)


def test_train_builtin_end_to_end(tmp_path, capsys):
    cfg = _tiny_train(tmp_path, "t1", "mxfp8")
    assert main(["train", "--config", str(cfg)]) == 0
    record = RunRecord.open(tmp_path / "runs" / "t1")
    assert [m["step"] for m in record.metrics()] == [1, 2]
    assert json.loads(record.plan_json)["recipe_name"] == "mxfp8"
    assert "run record at" in capsys.readouterr().out


def test_train_config_errors_name_the_key(tmp_path, capsys):
    bad = _write(tmp_path / "bad.yaml", {"model": "builtin:tiny-moe", "rl": {"stepz": 3}})
    assert main(["train", "--config", str(bad)]) == 2
    assert "stepz" in capsys.readouterr().err
    no_model = _write(tmp_path / "nomodel.yaml", {"rl": {"steps": 1}})
    assert main(["train", "--config", str(no_model)]) == 2
    assert "model" in capsys.readouterr().err


def test_dataset_source_runs_a_step(tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(5) for b in range(5)]
    rows.append({"prompt": 7, "label": "x"})  # malformed: counted, not fatal
    dataset = PromptDataset.from_rows(rows, seed=0)
    assert len(dataset.skipped) == 1
    tok = CharTokenizer()
    source = DatasetSource(dataset, tok, load_reward("integer"))
    model = build_model(builtin_config("tiny-moe"), seed=0)
    record = RunRecord.create(tmp_path, "ds", config={})
    trainer = GRPOTrainer(tiny_config(steps=1, recipe="bf16"), model, source, record)
    metrics = trainer.train_step()
    assert 0.0 <= metrics["reward/mean"] <= 1.0


def test_train_failing_before_step_one_is_recorded_failed(tmp_path, capsys, monkeypatch):
    import mxrl.app.train as train_mod

    class Broken(GRPOTrainer):
        def __init__(self, *args, **kwargs):
            raise ValueError("the engine refused the weights")

    monkeypatch.setattr(train_mod, "GRPOTrainer", Broken)
    cfg = _tiny_train(tmp_path, "broken", "mxfp8")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "the engine refused the weights" in capsys.readouterr().err
    assert main(["runs", "list", "--root", str(tmp_path / "runs")]) == 0
    listed = capsys.readouterr().out
    assert "broken" in listed and "mxfp8" in listed and "failed before step 1" in listed
    assert main(["runs", "show", "broken", "--root", str(tmp_path / "runs")]) == 0
    assert "ValueError: the engine refused the weights" in capsys.readouterr().out


def test_train_refuses_a_recipe_that_quantizes_nothing_before_writing_a_run(tmp_path, capsys):
    typo = _write(tmp_path / "typo.yaml", {
        "name": "typo", "rules": [{"match": {"name": "*.expertz.*"}, "format": "nvfp4"}],
    })  # fmt: skip
    cfg = _tiny_train(tmp_path, None, str(typo), steps=1)
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "quantizes nothing here" in err and "strict: false" in err
    assert not (tmp_path / "runs").exists()


def test_sigterm_ends_a_train_run_as_interrupted(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    cfg = _tiny_train(tmp_path, "term", "bf16", steps=500)
    env = {**os.environ, "MXRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mxrl.cli", "train", "--config", str(cfg)],
                            env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
    metrics = tmp_path / "runs" / "term" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "interrupted by SIGTERM" in err
    record = RunRecord.open(tmp_path / "runs" / "term")
    (end,) = record.events("end")
    assert end["status"] == "interrupted" and end["signal"] == "SIGTERM"
    assert end["step"] == len(record.metrics())


def test_train_resolves_the_run_once_and_records_the_plan_the_trainer_applies(
    tmp_path, monkeypatch
):
    """`mxrl train` makes the run's choices once (`resolve_train`) and hands them to the trainer,
    which resolves nothing again; the recorded plan is the one the trainer applied."""
    import mxrl.app.train as train_mod
    import mxrl.rl.trainer as trainer_mod

    calls, trainers = [], []
    real, real_init = train_mod.resolve_train, GRPOTrainer.__init__

    def counted(*args, **kwargs):
        calls.append(args[0].recipe)
        return real(*args, **kwargs)

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        trainers.append(self)

    def again(*args, **kwargs):
        raise AssertionError("the trainer resolved the run again")

    monkeypatch.setattr(train_mod, "resolve_train", counted)
    monkeypatch.setattr(trainer_mod, "resolve_train", again)
    monkeypatch.setattr(GRPOTrainer, "__init__", init)
    cfg = _tiny_train(tmp_path, "once", "mxfp8", steps=1)
    assert main(["train", "--config", str(cfg)]) == 0
    assert calls == ["mxfp8"] and len(trainers) == 1
    recorded = json.loads(RunRecord.open(tmp_path / "runs" / "once").plan_json)
    assert recorded == json.loads(trainers[0].plan.to_json())
