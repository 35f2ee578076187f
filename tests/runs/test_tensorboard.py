"""TensorBoard output of `mxrl train` and `mxrl demo` (mxrl/runs/tensorboard.py), read back with
TensorBoard's own EventAccumulator and compared with metrics.jsonl and events.jsonl."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mxrl.app import demo as demo_mod
from mxrl.cli import main
from mxrl.recipe import Plan
from mxrl.runs import RunRecord
from mxrl.runs.tensorboard import AUDIT_TAG, TENSORBOARD_DIR


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MXRL_CACHE", str(tmp_path / "cache"))


def _config(tmp_path: Path, name: str, **top) -> Path:
    """A `mxrl train` file on the built-in tiny model (5 warm-up steps), in seconds."""
    rl = {"recipe": "mxfp8", "prompts_per_step": 2, "samples_per_prompt": 2, **top.pop("rl", {})}
    data = {
        "model": "builtin:tiny-moe",
        "data": {"source": "builtin:arithmetic", "warmup_steps": 5},
        "out": str(tmp_path / "runs"),
        "rl": rl,
        **top,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _board(run: Path, texts: bool = False):
    """Every event file of the run's tensorboard/ folder. texts: the accumulator TensorBoard's
    server reads with (its plugins' data as tensors), which applies a resume's `purge_step` to
    text summaries too; the legacy EventAccumulator purges scalars only."""
    kind = plugin_event_accumulator.EventAccumulator if texts else EventAccumulator
    acc = kind(str(run / TENSORBOARD_DIR), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _f32(value: float) -> float:
    return float(np.float32(value))


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _texts(acc, tag: str) -> list[tuple[int, str]]:
    return [
        (e.step, textwrap.dedent(e.tensor_proto.string_val[0].decode())) for e in acc.Tensors(tag)
    ]


def _assert_board_is_the_record(run: Path) -> EventAccumulator:
    """Scalars: the metric names of metrics.jsonl (all numeric), each (step, value) the jsonl's
    at float32; text: each event type's events, their steps and fields."""
    record = RunRecord.open(run)
    rows = record.metrics()
    assert rows, "no metrics to compare"
    acc = _board(run)
    names = {k for row in rows for k in row if k != "step"}
    assert set(acc.Tags()["scalars"]) == names
    for name in names:
        want = [(r["step"], _f32(r[name])) for r in rows if name in r]
        got = [(e.step, e.value) for e in acc.Scalars(name)]
        assert [s for s, _ in got] == [s for s, _ in want], name
        assert all(_same(g, w) for (_, g), (_, w) in zip(got, want, strict=True)), name
    events = record.events()
    types = {e["type"] for e in events}
    board = _board(run, texts=True)
    text_tags = set(board.Tags()["tensors"]) - names
    assert text_tags == {AUDIT_TAG} | {f"events/{t}" for t in types}
    for kind in types:
        want = [
            (e["step"] or 0, {k: v for k, v in e.items() if k not in ("type", "step")})
            for e in events
            if e["type"] == kind
        ]
        got = [(step, json.loads(text)) for step, text in _texts(board, f"events/{kind}")]
        assert sorted(got, key=repr) == sorted(want, key=repr), kind
    ((step, audit),) = _texts(board, AUDIT_TAG)
    plan = Plan.from_json(record.plan_json)
    assert step == 0 and audit.strip() == f"{plan.table()}\nplan hash: {plan.hash()}"
    assert f"plan hash: {plan.hash()}" in audit and "mxfp8" in audit
    return acc


def test_train_and_its_resume_write_what_the_record_holds(tmp_path, capsys):
    """--tensorboard on a new run of 2 steps; then, its step-2 checkpoint deleted (as if killed
    before it), `resume:` with log.tensorboard from step 1, which re-runs step 2: a second event
    file, and TensorBoard shows step 2 once, with the resumed run's values and events."""
    cfg = _config(tmp_path, "new", run_id="tb", rl={"steps": 2, "checkpoint_every": 1})
    assert main(["train", "--config", str(cfg), "--tensorboard"]) == 0
    run = tmp_path / "runs" / "tb"
    first = _assert_board_is_the_record(run)
    assert [e.step for e in first.Scalars("reward/mean")] == [1, 2]
    assert {e["type"] for e in RunRecord.open(run).events()} >= {"memory_estimate", "end"}
    old_step2 = RunRecord.open(run).metrics()[1]

    (run / "checkpoints" / "step_000002.pt").unlink()
    resume = _config(tmp_path, "resume", resume=str(run), log={"tensorboard": True},
                     rl={"steps": 2, "checkpoint_every": 1})  # fmt: skip
    assert main(["train", "--config", str(resume)]) == 0, capsys.readouterr().err
    assert len(list((run / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 2
    acc = _assert_board_is_the_record(run)
    rows = RunRecord.open(run).metrics()
    assert [r["step"] for r in rows] == [1, 2]
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]
    (resumed,) = RunRecord.open(run).events("resume")
    assert resumed["step"] == 1
    # the re-run step 2 is not the first one (its timing at least): the board shows the new
    assert old_step2["time/train_s"] != rows[1]["time/train_s"]
    assert acc.Scalars("time/train_s")[1].value == _f32(rows[1]["time/train_s"])


def test_demo_runs_write_their_board(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_mod, "WARMUP_STEPS", 5)
    small = replace(demo_mod.demo_config("cpu"), prompts_per_step=2, samples_per_prompt=2,
                    eval_every=1)  # fmt: skip
    monkeypatch.setattr(demo_mod, "demo_config", lambda device: small)
    demo_mod.run_demo(tmp_path / "demo", recipes=("mxfp8",), seeds=1, steps=2, workers=1,
                      tensorboard=True)  # fmt: skip
    (run,) = (tmp_path / "demo" / "runs").iterdir()
    acc = _assert_board_is_the_record(run)
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [0, 1, 2]


def test_off_by_default_writes_no_board(tmp_path):
    cfg = _config(tmp_path, "off", run_id="off", rl={"steps": 1})
    assert main(["train", "--config", str(cfg)]) == 0
    run = tmp_path / "runs" / "off"
    assert RunRecord.open(run).metrics() and not (run / TENSORBOARD_DIR).exists()


@pytest.mark.parametrize("how", ["flag", "config", "demo"])
def test_without_the_package_it_refuses_before_writing(tmp_path, monkeypatch, capsys, how):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails
    if how == "demo":
        argv, written = ["demo", "--out", str(tmp_path / "demo"), "--tensorboard"], "demo"
    else:
        top = {"log": {"tensorboard": True}} if how == "config" else {}
        argv = ["train", "--config", str(_config(tmp_path, how, **top))]
        argv, written = argv + (["--tensorboard"] if how == "flag" else []), "runs"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mxrl: error: "), err
    assert "tensorboard" in err[0] and "pip install tensorboard" in err[0]
    assert not (tmp_path / written).exists() and not (tmp_path / "cache").exists()


def test_the_config_field_is_a_boolean_named_in_its_error(tmp_path, capsys):
    cfg = _config(tmp_path, "bad", log={"tensorboard": "yes"})
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "log.tensorboard: expected true or false" in err
    cfg = _config(tmp_path, "typo", log={"tensorbord": True})
    assert main(["train", "--config", str(cfg)]) == 2
    assert "did you mean 'tensorboard'" in capsys.readouterr().err
