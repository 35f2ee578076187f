"""What a run record says about when and with what code it ran: its span (first and last event
times, `RunRecord.span`) and env.json's `source_sha256`."""

from __future__ import annotations

import hashlib
import json

from mxrl.runs import RunRecord


def test_a_runs_span_is_its_first_and_last_event_time(tmp_path):
    rec = RunRecord.create(tmp_path, "r")
    assert RunRecord.open(rec.path).span() is None  # no event yet
    lines = [
        {"type": "sync_verified", "step": 1, "time": "2026-12-06T06:27:14.654Z"},
        {"type": "note", "step": 2},  # no time: not counted
        {"type": "sync_verified", "step": 2, "time": "2026-12-06T06:27:10.000Z"},  # earlier
        {"type": "sync_verified", "step": 3, "time": "not a time"},  # unreadable: not counted
        {"type": "sync_verified", "step": 4, "time": "2026-12-06T06:29:00.500Z"},
    ]
    (rec.path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    first, last = RunRecord.open(rec.path).span()
    # 06:27:10.000 and 06:29:00.500 UTC on 2026-12-06: 110.5 s apart, POSIX seconds
    assert last - first == 110.5
    assert first == 1796538430.0


def test_env_records_the_sources_sha256(tmp_path):
    from mxrl.runs.env import capture_env, source_sha256

    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "b.py").write_bytes(b"y = 2\n")
    (pkg / "a.py").write_bytes(b"x = 1\n")
    (pkg / "presets.yaml").write_bytes(b"name: p\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\x00compiled")  # not counted
    # by hand: each file's relative path, NUL, bytes, NUL, in path order
    expected = hashlib.sha256(
        b"a.py\x00x = 1\n\x00" + b"presets.yaml\x00name: p\n\x00" + b"sub/b.py\x00y = 2\n\x00"
    ).hexdigest()
    assert source_sha256(pkg) == expected
    (pkg / "sub" / "b.py").write_bytes(b"y = 3\n")
    assert source_sha256(pkg) != expected
    env = capture_env()
    assert env["source_sha256"] == source_sha256() and len(env["source_sha256"]) == 64
