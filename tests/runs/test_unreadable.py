"""Runs that cannot be read: `mxrl runs list` reports them and goes on with the others, `show`
refuses one with one `mxrl: error:` line, `compare` leaves it out (docs/runs.md, "Runs that
cannot be read"). The broken folders are made by hand from a good synthetic run."""

from __future__ import annotations

import os
import pathlib

import pytest

from mxrl.cli import main
from mxrl.runs import RunRecord, compare, summarize

# (case, how to break a good run folder, the line naming it, unreadable?)
BROKEN = [
    (
        "config-not-yaml",
        lambda p: (p / "config.yaml").write_text("recipe: [bf16\nlr: 1\n"),
        "config.yaml is not valid YAML (line 2",
        True,
    ),
    (
        "config-a-list",
        lambda p: (p / "config.yaml").write_text("- bf16\n- mxfp8\n"),
        "config.yaml holds a YAML list, not a mapping",
        True,
    ),
    (
        "env-not-json",
        lambda p: (p / "env.json").write_text('{"start_time": '),
        "env.json is not valid JSON (line 1, column 16",
        True,
    ),
    (
        "env-a-list",
        lambda p: (p / "env.json").write_text("[1, 2]"),
        "env.json holds a JSON list, not an object",
        True,
    ),
    (
        "env-not-utf8",
        lambda p: (p / "env.json").write_bytes(b'{"host": "\xff"}'),
        "env.json is not UTF-8 text (byte 0xff at offset 10)",
        True,
    ),
    (
        "metrics-a-folder",
        lambda p: (os.remove(p / "metrics.jsonl"), os.mkdir(p / "metrics.jsonl")),
        "metrics.jsonl cannot be read (Is a directory)",
        True,
    ),
    (
        "metrics-garbage",
        lambda p: (p / "metrics.jsonl").write_text("}{ not json\n" + "\x00\x01\n" * 2),
        "metrics.jsonl: ignored unreadable line 1",
        False,
    ),
    (
        "files-missing",
        lambda p: [os.remove(p / n) for n in ("config.yaml", "metrics.jsonl", "events.jsonl")],
        "config.yaml is missing; metrics.jsonl is missing; events.jsonl is missing",
        False,
    ),
]
IDS = [b[0] for b in BROKEN]
CASE = {b[0]: b for b in BROKEN}


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _broken(make_run, case):
    name, breaks, _, _ = case
    rec = make_run(name, steps=3)
    breaks(rec.path)
    return rec


@pytest.mark.parametrize("case", BROKEN, ids=IDS)
def test_list_reports_the_broken_run_and_goes_on(make_run, capsys, case):
    make_run("good", steps=4, start_time="2025-01-01T10:00:00.000Z")
    _broken(make_run, case)
    code, out, err = run(capsys, "runs", "list", "--root", make_run.root)
    assert code == 0, err
    assert "Traceback" not in err
    table, _, notes = out.partition("\n\nproblems reading runs:\n")
    rows = {ln.split()[0]: ln.split() for ln in table.splitlines()[1:]}
    assert rows["good"][:5] == ["good", "nvfp4-dequantized", "4", "0.16", "finished"]
    assert (rows[case[0]][4] == "unreadable") == case[3], rows[case[0]]
    assert notes.splitlines() == [f"  {case[0]}: " + notes.split(f"{case[0]}: ", 1)[1].strip()]
    assert case[2] in notes


@pytest.mark.parametrize("case", [b for b in BROKEN if b[3]], ids=[b[0] for b in BROKEN if b[3]])
def test_show_refuses_an_unreadable_run_in_one_line(make_run, capsys, case):
    rec = _broken(make_run, case)
    code, out, err = run(capsys, "runs", "show", rec.run_id, "--root", make_run.root)
    assert code == 2 and out == ""
    assert err.startswith(f"mxrl: error: run {case[0]} (")
    assert case[2] in err and len(err.splitlines()) == 1
    assert "Fix or remove the file" in err


@pytest.mark.parametrize(
    "case", [b for b in BROKEN if not b[3]], ids=[b[0] for b in BROKEN if not b[3]]
)
def test_show_lists_the_problems_of_a_readable_run(make_run, capsys, case):
    rec = _broken(make_run, case)
    code, out, _ = run(capsys, "runs", "show", rec.run_id, "--root", make_run.root)
    assert code == 0
    problems = out.split("problems reading the record:\n", 1)[1]
    for part in case[2].split("; "):
        assert f"  {part}" in problems


def test_a_permission_error_is_an_unreadable_run(make_run, capsys, monkeypatch):
    """(The tests may run as root, for whom chmod denies nothing: the read is made to fail.)"""
    rec = make_run("locked", steps=2)
    make_run("good", steps=2)
    real = pathlib.Path.read_text

    def read_text(self, *args, **kwargs):
        if self == rec.path / "config.yaml":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    code, out, _ = run(capsys, "runs", "list", "--root", make_run.root)
    assert code == 0 and "locked: config.yaml cannot be read (Permission denied)" in out
    rows = {ln.split()[0]: ln.split()[4] for ln in out.splitlines()[1:3]}
    assert rows == {"locked": "unreadable", "good": "finished"}
    code, _, err = run(capsys, "runs", "show", "locked", "--root", make_run.root)
    assert code == 2 and "config.yaml cannot be read (Permission denied)" in err


def test_compare_leaves_an_unreadable_run_out(make_run, tmp_path, caplog):
    make_run("a", "bf16", steps=3)
    bad = _broken(make_run, CASE["config-not-yaml"])
    result = compare([make_run.root / "a", bad.path], tmp_path / "report")
    assert list(result.unreadable) == [bad.run_id]
    assert "| metric | bf16 |" in result.table and bad.run_id not in result.table
    text = result.markdown.read_text()
    assert "## Runs left out (cannot be read)" in text and "config.yaml is not valid YAML" in text
    assert any("left out of compare" in r.getMessage() for r in caplog.records)


def test_compare_of_unreadable_runs_only_refuses_before_writing(make_run, capsys, tmp_path):
    bad = _broken(make_run, CASE["env-not-json"])
    out_dir = tmp_path / "report"
    code, out, err = run(
        capsys, "runs", "compare", bad.run_id, "--out", out_dir, "--root", make_run.root
    )
    assert code == 2 and out == "" and not out_dir.exists()
    assert err.startswith("mxrl: error: run env-not-json (") and len(err.splitlines()) == 1
    other = _broken(make_run, CASE["metrics-a-folder"])
    with pytest.raises(ValueError, match=r"none of the runs can be read .*env-not-json.*metrics"):
        compare([bad.path, other.path], out_dir)
    assert not out_dir.exists()


def test_a_step_zero_evaluation_row_is_not_a_step(tmp_path, capsys):
    """The loop logs the starting policy's held-out accuracy at step 0 in a row of its own
    (eval_every), then steps 1..N: N steps, not N + 1."""
    rec = RunRecord.create(tmp_path, "r", config={"recipe": "bf16"})
    rec.log_metrics(0, {"eval/accuracy": 0.25})
    for step in (1, 2, 3):
        row = {"reward/mean": 0.1 * step}
        if step == 3:
            row["eval/accuracy"] = 0.5
        rec.log_metrics(step, row)
    rec.finish(3)
    s = summarize(rec)
    assert (s.num_steps, s.last_step) == (3, 3)
    code, out, _ = run(capsys, "runs", "list", "--root", tmp_path)
    assert code == 0 and out.splitlines()[1].split()[:3] == ["r", "bf16", "3"]
    code, out, _ = run(capsys, "runs", "show", "r", "--root", tmp_path)
    assert "status: finished; 3 steps logged, last step 3" in out
    assert "| steps logged | 3 |" in compare([rec], tmp_path / "cmp").table


def test_whatever_the_records_own_readers_refuse_is_unreadable(make_run, capsys, monkeypatch):
    """The checks follow the record's readers: a loader stricter than the checks (one that
    refuses duplicate keys, say) marks the run unreadable too, not the whole listing."""
    rec = make_run("dup", steps=2)
    make_run("good", steps=2)
    real = RunRecord.config

    def config(self):
        if self.path == rec.path:
            raise ValueError("config.yaml: duplicate key 'lr' (lines 1 and 3)")
        return real.fget(self)

    monkeypatch.setattr(RunRecord, "config", property(config))
    code, out, _ = run(capsys, "runs", "list", "--root", make_run.root)
    assert code == 0
    assert "dup: the run record cannot be read (config.yaml: duplicate key 'lr'" in out
    code, _, err = run(capsys, "runs", "show", "dup", "--root", make_run.root)
    assert code == 2 and len(err.splitlines()) == 1 and "duplicate key 'lr'" in err
