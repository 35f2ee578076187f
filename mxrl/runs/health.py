"""Whether a run folder can be read, so that `mxrl runs` reports a broken run instead of failing
on it (docs/runs.md, "Runs that cannot be read").

A run is *unreadable* when one of its files exists but cannot be read or parsed: config.yaml
that is not YAML (or not a mapping), env.json that is not a JSON object, a file that is not
UTF-8 text, a permission error, a folder where a file should be. `list` shows such a run as a
row marked unreadable and names the file below the table; `show` refuses it with one line
naming the file; `compare` leaves it out (or refuses, when no run is left). A missing file, a
truncated or garbage line in metrics.jsonl / events.jsonl are *problems* only: what can be read
is reported, and the problems are listed (`RunRecord.problems` has the lines skipped).

Every message here is one line (the CLI prints it after `mxrl: error:`).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from mxrl.runs.read import CONFIG_FILE, ENV_FILE, EVENTS_FILE, METRICS_FILE, NOTES_FILE, PLAN_FILE
from mxrl.runs.record import RunRecord, is_run_dir

logger = logging.getLogger(__name__)

# What `RunRecord.create` writes (plan.json only when given a plan).
EXPECTED_FILES = (CONFIG_FILE, ENV_FILE, METRICS_FILE, EVENTS_FILE, NOTES_FILE)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


class _Unreadable(Exception):
    pass


def _os_error(e: OSError) -> str:
    return f"cannot be read ({e.strerror or type(e).__name__})"


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        byte = e.object[e.start]
        raise _Unreadable(f"is not UTF-8 text (byte 0x{byte:02x} at offset {e.start})") from None
    except OSError as e:
        raise _Unreadable(_os_error(e)) from None


def _yaml_mapping(path: Path) -> None:
    try:
        data = yaml.safe_load(_text(path))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise _Unreadable(f"is not valid YAML ({where}{one_line(e.problem or e)})") from None
    except yaml.YAMLError as e:
        raise _Unreadable(f"is not valid YAML ({one_line(e)})") from None
    if data is not None and not isinstance(data, dict):
        raise _Unreadable(f"holds a YAML {type(data).__name__}, not a mapping of settings")


def _json_object(path: Path) -> None:
    try:
        data = json.loads(_text(path))
    except json.JSONDecodeError as e:
        raise _Unreadable(
            f"is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    if not isinstance(data, dict):
        raise _Unreadable(f"holds a JSON {type(data).__name__}, not an object")


def _bytes(path: Path) -> None:
    try:
        path.read_bytes()
    except OSError as e:
        raise _Unreadable(_os_error(e)) from None


# file -> the check that it can be read and parsed as the record reads it
_CHECKS: dict[str, Callable[[Path], Any]] = {
    CONFIG_FILE: _yaml_mapping,
    ENV_FILE: _json_object,
    PLAN_FILE: _text,  # its content is shown as it is (show says when it is not JSON)
    METRICS_FILE: _bytes,  # lines that do not parse are skipped and listed (record.problems)
    EVENTS_FILE: _bytes,
    NOTES_FILE: _text,
}


def unreadable(record: RunRecord) -> list[str]:
    """One line per file that exists but cannot be read or parsed ([] for a readable run)."""
    out = []
    for name, check in _CHECKS.items():
        path = record.path / name
        try:
            if path.exists():  # (a folder that cannot be searched raises here)
                check(path)
        except _Unreadable as e:
            out.append(f"{name} {e}")
        except OSError as e:
            out.append(f"{name} {_os_error(e)}")
    return out or _readers_fail(record)


def _readers_fail(record: RunRecord) -> list[str]:
    """What the record's own readers raise on the folder (they may be stricter than the checks
    above, e.g. a YAML loader that refuses duplicate keys): one line, or []."""
    try:
        record.config, record.env, record.plan_json, record.notes()  # each one reads its file
        record.metrics(), record.events()
    except (ValueError, TypeError, OSError, yaml.YAMLError) as e:
        return [f"the run record cannot be read ({one_line(e)})"]
    return []


def missing(record: RunRecord) -> list[str]:
    """The files `RunRecord.create` writes that the folder lacks, one line each."""
    out = []
    for name in EXPECTED_FILES:
        try:
            if not (record.path / name).exists():
                out.append(f"{name} is missing")
        except OSError:  # reported by `unreadable`
            continue
    return out


def problems(record: RunRecord) -> list[str]:
    """Everything worth telling about a run's files: unreadable files, missing files, and (for
    a readable run) the lines the readers skipped."""
    bad = unreadable(record)
    return bad + missing(record) + ([] if bad else record.problems)


def refuse_unreadable(record: RunRecord) -> None:
    """ValueError, one line, when the run cannot be read (`unreadable`)."""
    bad = unreadable(record)
    if bad:
        raise ValueError(
            f"run {record.run_id} ({record.path}) cannot be read: {'; '.join(bad)}. Fix or "
            "remove the file, or move the run folder out of the runs folder"
        )


def safe_env(record: RunRecord) -> dict[str, Any]:
    """record.env, or {} when env.json cannot be read (record.env already gives {} for a file
    that is missing or not JSON)."""
    try:
        return record.env
    except (OSError, UnicodeDecodeError):
        return {}


def split_readable(
    records: Sequence[RunRecord], what: str
) -> tuple[list[RunRecord], dict[str, list[str]]]:
    """(the readable runs, {run id: why} of the others), with a warning for each left out;
    ValueError when none is readable (`what` names the command)."""
    bad = [unreadable(r) for r in records]
    if records and all(bad):
        if len(records) == 1:
            refuse_unreadable(records[0])
        names = "; ".join(f"{r.run_id}: {', '.join(b)}" for r, b in zip(records, bad, strict=True))
        raise ValueError(f"{what}: none of the runs can be read ({names}); fix or leave them out")
    left_out = {r.run_id: b for r, b in zip(records, bad, strict=True) if b}
    for run_id, items in left_out.items():
        logger.warning("run %s cannot be read, left out of %s: %s", run_id, what, "; ".join(items))
    return [r for r, b in zip(records, bad, strict=True) if not b], left_out


def looks_like_run(path: Path) -> bool:
    """`is_run_dir`, and a folder that cannot be looked into (listed, as unreadable)."""
    try:
        return is_run_dir(path)
    except OSError:
        return path.is_dir()


def start_key(record: RunRecord) -> str:
    """env.json's start time, else the folder's time, as a sortable UTC string ("" if none)."""
    start = safe_env(record).get("start_time")
    if isinstance(start, str):
        return start
    try:
        mtime = dt.datetime.fromtimestamp(record.path.stat().st_mtime, dt.UTC)
    except OSError:
        return ""
    return mtime.strftime("%Y-%m-%dT%H:%M:%S.000Z")
