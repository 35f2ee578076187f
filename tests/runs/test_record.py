"""RunRecord: the files of a run, append-only writes, tolerant reads, resume."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import yaml

from mxrl.runs import RunRecord, new_run_id
from mxrl.weights import QuantizationEvent
from tests.runs.synthetic import strict_json


class FakePlan:
    def to_json(self, indent=None):
        return json.dumps({"recipe_name": "bf16", "hash": "abc", "tensors": []}, indent=indent)


def test_create_writes_every_file(tmp_path):
    config = {"recipe": "mxfp8", "lr": 1e-6, "model": {"name": "tiny-moe", "layers": 4}}
    rec = RunRecord.create(tmp_path, "r1", config=config, plan_json=FakePlan(), backend="triton")
    assert rec.path == tmp_path / "r1" and rec.run_id == "r1"
    names = {p.name for p in rec.path.iterdir()}
    assert names == {
        "config.yaml",
        "plan.json",
        "env.json",
        "metrics.jsonl",
        "events.jsonl",
        "notes.md",
    }
    assert yaml.safe_load((rec.path / "config.yaml").read_text()) == config
    assert rec.config == config and rec.recipe == "mxfp8"
    assert json.loads(rec.plan_json)["hash"] == "abc"
    env = rec.env
    assert env["backend"] == "triton"
    assert isinstance(env["git"]["commit"], str) and env["git"]["commit"]
    assert {"python", "torch", "numpy", "safetensors", "mxrl", "triton", "transformers"} <= set(
        env["versions"]
    )
    assert env["device"]["cpu"] and env["device"]["cuda_count"] >= 0
    assert env["hostname"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", env["start_time"])
    assert rec.metrics() == [] and rec.events() == []


def test_dataclass_config(tmp_path):
    import dataclasses
    import enum
    from pathlib import Path

    class Mode(enum.Enum):
        HP = "high_precision"

    @dataclasses.dataclass
    class Opt:
        lr: float = 1e-6
        betas: tuple = (0.9, 0.99)

    @dataclasses.dataclass
    class Config:
        recipe: str = "nvfp4-hp"
        mode: Mode = Mode.HP
        data: Path = Path("/data/dapo")
        opt: Opt = dataclasses.field(default_factory=Opt)

    rec = RunRecord.create(tmp_path, "r", config=Config())
    assert rec.config == {
        "recipe": "nvfp4-hp",
        "mode": "high_precision",
        "data": "/data/dapo",
        "opt": {"lr": 1e-6, "betas": [0.9, 0.99]},
    }
    with pytest.raises(TypeError, match="config must be a mapping"):
        RunRecord.create(tmp_path, "r2", config=[1, 2])
    with pytest.raises(TypeError, match=r"config\.x: cannot write a object"):
        RunRecord.create(tmp_path, "r3", config={"x": object()})
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()


def test_str_enums_are_written_as_their_values(tmp_path):
    """A StrEnum's member is a str: written as its value (`correction: tis`), not a YAML or
    JSON of the enum, in config.yaml and the events."""
    from mxrl.rl.config import GRPOConfig

    cfg = GRPOConfig(correction="tis", spike_action="skip")
    rec = RunRecord.create(tmp_path, "r", config={"rl": cfg, "mode": cfg.correction})
    text = (rec.path / "config.yaml").read_text()
    assert "mode: tis\n" in text and "  correction: tis\n" in text and "spike_action: skip" in text
    rec.log_event("config_change", 1, new=cfg.compute_dtype)
    assert strict_json((rec.path / "events.jsonl").read_text().splitlines()[-1])["new"] == "auto"


def test_default_id_and_plan_text(tmp_path):
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", new_run_id())
    rec = RunRecord.create(tmp_path, config={"recipe": {"name": "nvfp4-hp"}}, plan_json="{}")
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", rec.run_id)
    assert rec.plan_json == "{}\n" and rec.recipe == "nvfp4-hp"
    with pytest.raises(ValueError, match="plan_json is not valid JSON"):
        RunRecord.create(tmp_path, "bad-plan", plan_json="{nope")


def test_refuses_to_overwrite(tmp_path):
    rec = RunRecord.create(tmp_path, "r1", config={"lr": 1})
    rec.log_metrics(0, {"reward/mean": 1.0})
    with pytest.raises(ValueError, match="already exists"):
        RunRecord.create(tmp_path, "r1", config={"lr": 2})
    assert rec.config == {"lr": 1} and len(rec.metrics()) == 1
    for bad in ("", "a/b", ".."):
        with pytest.raises(ValueError, match="run_id"):
            RunRecord.create(tmp_path, bad)


def test_metrics_round_trip_with_non_finite(tmp_path):
    rec = RunRecord.create(tmp_path, "r")
    for s in range(30):
        rec.log_metrics(s, {"reward/mean": 0.1 + 0.02 * s, "grad/spike": s == 3, "n": 2})
    rec.log_metrics(30, {"a": math.nan, "b": math.inf, "c": -math.inf})
    lines = (rec.path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 31
    rows = [strict_json(ln) for ln in lines]  # standard JSON: no NaN / Infinity tokens
    assert rows[30] == {"step": 30, "a": "nan", "b": "inf", "c": "-inf"}
    got = rec.metrics()
    assert [r["step"] for r in got] == list(range(31))
    assert got[5]["reward/mean"] == pytest.approx(0.2)
    assert got[3]["grad/spike"] == 1.0 and got[4]["grad/spike"] == 0.0 and got[0]["n"] == 2.0
    assert math.isnan(got[30]["a"]) and got[30]["b"] == math.inf and got[30]["c"] == -math.inf


def test_metrics_accept_tensors_refuse_strings(tmp_path):
    import numpy as np
    import torch

    rec = RunRecord.create(tmp_path, "r")
    rec.log_metrics(0, {"t": torch.tensor(0.5), "np": np.float32(0.25)})
    assert rec.metrics() == [{"step": 0, "t": 0.5, "np": 0.25}]
    with pytest.raises(TypeError, match="'x' is a string"):
        rec.log_metrics(1, {"x": "0.5"})
    with pytest.raises(TypeError, match="'x' is a list"):
        rec.log_metrics(1, {"x": [1.0]})
    with pytest.raises(ValueError, match="first argument"):
        rec.log_metrics(1, {"step": 1})
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="step must be an int"):
            rec.log_metrics(bad, {})


def test_events_typed_and_free_form(tmp_path):
    rec = RunRecord.create(tmp_path, "r")
    qe = QuantizationEvent(4, "h", 10, 2048, 0.5, {"layer.0": 21.0, "other": math.inf})
    rec.log_quantization(qe)
    rec.log_spike(5, 30.0, 6.1, [("layers.2", 25.0), ("lm_head", 1.0)])
    rec.log_skipped_rows(5, 12, [f"row {i}: no answer" for i in range(20)])
    rec.log_sync_verified(5, version=6, plan_hash="h", ok=True, seconds=0.2)
    rec.log_event("note", None, text="warmup over")
    rec.log_event("lr_change", 6, lr=1e-5)
    events = rec.events()
    assert [e["type"] for e in events] == [
        "quantization",
        "spike",
        "skipped_rows",
        "sync_verified",
        "note",
        "lr_change",
    ]
    assert all(set(e) >= {"type", "step", "time"} for e in events)
    for line in (rec.path / "events.jsonl").read_text().splitlines():
        strict_json(line)
    (q,) = rec.events("quantization")
    assert q["step"] == 4 and QuantizationEvent.from_dict(q) == qe
    (spike,) = rec.events("spike")
    assert spike["top_layers"] == {"layers.2": 25.0, "lm_head": 1.0} and spike["z"] == 6.1
    (skip,) = rec.events("skipped_rows")
    assert skip["count"] == 12 and len(skip["reasons"]) == 10
    (sync,) = rec.events("sync_verified")
    assert sync == {**sync, "version": 6, "plan_hash": "h", "ok": True, "seconds": 0.2}
    assert rec.events("lr_change")[0]["lr"] == 1e-5
    with pytest.raises(ValueError, match="set by log_event"):
        rec.log_event("x", 1, time=3)
    with pytest.raises(ValueError, match="event type"):
        rec.log_event("", 1)


def test_truncated_last_line_tolerated_then_repaired(tmp_path, caplog):
    rec = RunRecord.create(tmp_path, "r")
    for s in range(5):
        rec.log_metrics(s, {"reward/mean": float(s)})
        rec.log_event("tick", s)
    with open(rec.path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "reward/me')  # a writer killed mid-line
    with open(rec.path / "events.jsonl", "a") as f:
        f.write('{"type": "ti')

    reader = RunRecord.open(rec.path)
    with caplog.at_level(logging.WARNING, logger="mxrl.runs"):
        for _ in range(3):
            assert [r["step"] for r in reader.metrics()] == [0, 1, 2, 3, 4]
            assert len(reader.events()) == 5
    truncated = [r for r in caplog.records if "truncated last line" in r.getMessage()]
    assert len(truncated) == 2  # once per file, not once per read
    assert any("metrics.jsonl" in p for p in reader.problems)
    assert (rec.path / "metrics.jsonl").read_text().endswith("reward/me")  # reading never writes

    writer = RunRecord.open(rec.path)
    writer.log_metrics(5, {"reward/mean": 5.0})
    writer.log_event("tick", 5)
    for name in ("metrics.jsonl", "events.jsonl"):
        lines = (rec.path / name).read_text().splitlines()
        assert len(lines) == 6 and all(strict_json(ln) for ln in lines)
    assert [r["step"] for r in writer.metrics()] == list(range(6))


def test_garbage_line_in_the_middle_is_skipped(tmp_path):
    rec = RunRecord.create(tmp_path, "r")
    rec.log_metrics(0, {"a": 1.0})
    with open(rec.path / "metrics.jsonl", "a") as f:
        f.write("not json\n[1, 2]\n")
    rec.log_metrics(1, {"a": 2.0})
    assert [r["a"] for r in rec.metrics()] == [1.0, 2.0]
    assert any("unreadable line 2" in p for p in rec.problems)
    assert any("not a JSON object" in p for p in rec.problems)


def test_truncate_after_and_resume(tmp_path):
    rec = RunRecord.create(tmp_path, "r")
    for s in range(10):
        rec.log_metrics(s, {"reward/mean": float(s)})
        rec.log_sync_verified(s, version=s, plan_hash="h", ok=True)
    rec.log_event("note", None, text="no step")
    with open(rec.path / "metrics.jsonl", "a") as f:
        f.write('{"step": 10, "rew')  # killed while logging step 10

    # the process dies; the last checkpoint was taken at step 6
    before = {p.name: p.read_bytes() for p in rec.path.iterdir()}
    resumed = RunRecord.open(rec.path)  # opening and reading modify nothing
    assert len(resumed.metrics()) == 10 and resumed.events()
    assert {p.name: p.read_bytes() for p in rec.path.iterdir()} == before
    resumed.resume(6, checkpoint=tmp_path / "ckpt-6", backend="x")
    assert [r["step"] for r in resumed.metrics()] == list(range(7))
    (resume,) = resumed.events("resume")
    assert resume["step"] == 6 and resume["from_step"] == 6
    assert resume["checkpoint"].endswith("ckpt-6") and resume["env"]["backend"] == "x"
    assert [e["step"] for e in resumed.events("sync_verified")] == list(range(7))
    assert len(resumed.events("note")) == 1  # events without a step are kept
    for s in range(7, 12):
        resumed.log_metrics(s, {"reward/mean": float(s)})
    lines = (rec.path / "metrics.jsonl").read_text().splitlines()
    assert [strict_json(ln)["step"] for ln in lines] == list(range(12))  # one line per step
    assert resumed.truncate_after(9) == (2, 0)
    assert resumed.metrics()[-1]["step"] == 9


def test_duplicate_steps_keep_the_last(tmp_path, caplog):
    rec = RunRecord.create(tmp_path, "r")
    for s, v in ((0, 0.0), (1, 1.0), (2, 2.0), (1, 11.0)):
        rec.log_metrics(s, {"v": v})
    with caplog.at_level(logging.WARNING, logger="mxrl.runs"):
        assert len(rec.metrics()) == 3
        rec.log_metrics(2, {"v": 12.0})
        rows = rec.metrics()
    assert [(r["step"], r["v"]) for r in rows] == [(0, 0.0), (1, 11.0), (2, 12.0)]
    assert rec.problems == [
        "metrics.jsonl: 2 step(s) logged more than once (kept the last); call "
        "truncate_after(step) when resuming"
    ]
    assert sum("more than once" in r.getMessage() for r in caplog.records) == 1


def test_notes_appended_with_timestamps(tmp_path):
    rec = RunRecord.create(tmp_path, "r")
    rec.note("first note")
    rec.note("second\nnote", step=7)
    text = rec.notes()
    assert text.startswith("# Notes: run r\n")
    assert text.index("first note") < text.index("second\nnote")
    assert re.search(r"## \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \(step 7\)\n\nsecond", text)
    with pytest.raises(ValueError, match="empty"):
        rec.note("  ")


def test_open_refuses_a_non_run(tmp_path):
    with pytest.raises(ValueError, match="not a run directory"):
        RunRecord.open(tmp_path)


def test_real_plan_round_trips(tmp_path):
    from mxrl.arch import builtin_config, tensors_from_hf_config
    from mxrl.recipe import Plan, resolve
    from mxrl.runs import format_show

    plan = resolve("nvfp4-dequantized", tensors_from_hf_config(builtin_config("tiny-moe")))
    rec = RunRecord.create(tmp_path, "r", config={"recipe": plan.recipe_name}, plan_json=plan)
    assert Plan.from_json(rec.plan_json).hash() == plan.hash()
    assert f"plan: nvfp4-dequantized, dequantized, hash {plan.hash()}" in format_show(rec)


def test_repair_tail_edges(tmp_path):
    from mxrl.runs.jsonl import repair_tail

    path = tmp_path / "m.jsonl"
    assert repair_tail(path) == 0  # missing file
    path.write_bytes(b'{"step": 0')  # only a partial line
    assert repair_tail(path) == 10 and path.read_bytes() == b""
    path.write_bytes(b'{"a": 1}\n' + b"x" * 100_000)  # a partial line longer than one chunk
    assert repair_tail(path) == 100_000 and path.read_bytes() == b'{"a": 1}\n'
    assert repair_tail(path) == 0


# --- how a run ends ----------------------------------------------------------------------------


def _status(rec):
    from mxrl.runs import summarize

    return summarize(rec).status


def test_guard_records_a_failure_with_its_step_and_error(tmp_path):
    rec = RunRecord.create(tmp_path, "f", config={"rl": {"recipe": "mxfp8"}})
    assert rec.recipe == "mxfp8"  # `mxrl train` files keep the recipe under rl:
    step = 0
    with pytest.raises(ZeroDivisionError), rec.guard(lambda: step):
        step = 3
        1 / 0  # noqa: B018
    (end,) = rec.events("end")
    assert end["status"] == "failed" and end["step"] == 3
    assert end["error"] == "ZeroDivisionError: division by zero"
    assert "1 / 0" in end["traceback"]
    assert _status(rec) == "failed at step 3"


def test_a_failure_before_step_one_says_so_and_inner_guards_record_once(tmp_path):
    rec = RunRecord.create(tmp_path, "f0", config={})
    with pytest.raises(ValueError, match="bad weights"), rec.guard(lambda: 0), rec.guard(lambda: 0):
        raise ValueError("bad weights")
    assert len(rec.events("end")) == 1
    assert _status(rec) == "failed before step 1"


def test_ctrl_c_and_sigterm_are_recorded_as_interrupted(tmp_path):
    import os
    import signal

    from mxrl.runs import RunInterrupted

    rec = RunRecord.create(tmp_path, "i", config={})
    with pytest.raises(KeyboardInterrupt), rec.guard(lambda: 5):
        raise KeyboardInterrupt
    assert _status(rec) == "interrupted (SIGINT) at step 5"
    rec = RunRecord.create(tmp_path, "t", config={})
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunInterrupted), rec.guard(lambda: 2):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0.5) if hasattr(signal, "sigtimedwait") else None
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
    (end,) = rec.events("end")
    assert end["status"] == "interrupted" and end["signal"] == "SIGTERM"


def test_a_run_without_an_end_is_running_while_its_process_lives(tmp_path):
    import subprocess
    import sys

    rec = RunRecord.create(tmp_path, "alive", config={})
    assert _status(rec) == "running"  # this process
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    env = rec.env
    env["pid"] = int(child.stdout)  # a process that has exited: killed without a record
    (rec.path / "env.json").write_text(json.dumps(env))
    assert _status(rec) == "unfinished"
    rec.finish(4)
    assert _status(rec) == "finished"


def test_resume_rewrites_the_config_and_records_each_change(tmp_path):
    rec = RunRecord.create(tmp_path, "r", config={"rl": {"lr": 1e-4, "steps": 4}})
    for s in range(1, 5):
        rec.log_metrics(s, {"a": float(s)})
    rec.finish(4)  # a finished run, resumed from its last checkpoint to train longer
    changes = [
        {"field": "rl.lr", "old": 1e-4, "new": 1e-2},
        {"field": "rl.steps", "old": 4, "new": 6},
    ]
    rec.resume(4, checkpoint="ckpt-4", config={"rl": {"lr": 1e-2, "steps": 6}}, changes=changes)
    assert yaml.safe_load((rec.path / "config.yaml").read_text()) == {
        "rl": {"lr": 0.01, "steps": 6}
    }
    got = [(e["step"], e["field"], e["old"], e["new"]) for e in rec.events("config_change")]
    assert got == [(5, "rl.lr", 1e-4, 1e-2), (5, "rl.steps", 4, 6)]  # from step 5 on
    # the old end moved into the resume event: the run is going on again
    assert [e["type"] for e in rec.events()] == ["resume", "config_change", "config_change"]
    assert rec.events("resume")[0]["previous_end"]["status"] == "finished"
    assert len(rec.metrics()) == 4
    # resumed again from the same checkpoint: the changes of the first resume (from step 5) go
    rec.resume(4, checkpoint="ckpt-4")
    assert rec.events("config_change") == [] and len(rec.events("resume")) == 2
