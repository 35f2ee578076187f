"""Append-only JSON lines: safe encoding, a reader that survives a killed writer, tail repair.

A process killed while appending can leave a last line without its newline (a partial JSON
object). Readers skip it and say so once; the next writer drops it before appending, so the file
never holds two records fused on one line.

Non-finite floats are not JSON: they are written as the strings "nan", "inf" and "-inf" (as
`QuantizationEvent.to_dict` writes infinite SQNRs) and turned back into floats by
`decode_float`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def to_jsonable(value: Any, where: str = "value") -> Any:
    """Plain JSON types: non-finite floats as strings, tensors/numpy scalars as numbers or lists,
    dataclasses and mappings as dicts, enums as their value, paths as strings."""
    if isinstance(value, enum.Enum):  # before str and int: a StrEnum's member is a str
        return to_jsonable(value.value, where)
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value), where)
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    tolist = getattr(value, "tolist", None)  # torch tensors, numpy arrays and scalars
    if callable(tolist):
        return to_jsonable(tolist(), where)
    raise TypeError(
        f"{where}: cannot write a {type(value).__name__} to the run record; pass numbers, "
        "strings, lists or dicts"
    )


def to_float(value: Any, where: str) -> float:
    """A metric value as a float (ints, bools, 0-d tensors, numpy scalars); strings refused."""
    if isinstance(value, str | bytes):
        raise TypeError(f"metric {where!r} is a string ({value!r}); metrics are numbers")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"metric {where!r} is a {type(value).__name__}, not a number; log float(...) of it"
        ) from None


def decode_float(value: Any) -> Any:
    """Inverse of the non-finite encoding: "nan"/"inf"/"-inf" back to floats, others unchanged."""
    if isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    return value


def encode_line(obj: Mapping[str, Any]) -> str:
    return json.dumps(to_jsonable(obj), allow_nan=False, ensure_ascii=False) + "\n"


@dataclass
class ReadResult:
    """The records of a JSON-lines file; problems: human-readable, one per unreadable line."""

    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def read_jsonl(path: Path) -> ReadResult:
    """Every line that parses as a JSON object; a missing file reads as empty."""
    result = ReadResult()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return result
    lines = data.split(b"\n")
    complete = len(lines) - 1  # the piece after the last newline is partial (or empty)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        if i == complete:
            result.problems.append(
                f"{path.name}: ignored a truncated last line ({len(raw)} bytes, no newline; "
                "a writer was killed mid-line)"
            )
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            result.problems.append(f"{path.name}: ignored unreadable line {i + 1}")
            continue
        if not isinstance(obj, dict):
            result.problems.append(f"{path.name}: ignored line {i + 1} (not a JSON object)")
            continue
        result.records.append(obj)
    return result


def repair_tail(path: Path) -> int:
    """Drop a partial last line (no newline) left by a killed writer; returns bytes dropped."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # Scan back for the last newline in chunks (a line is small; files may be large).
        pos, keep = size, 0
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            chunk = f.read(pos - start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        f.truncate(keep)
        return size - keep


def append_line(path: Path, obj: Mapping[str, Any]) -> None:
    """One record, flushed to the OS before returning (survives a killed process)."""
    line = encode_line(obj)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def rewrite(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Replace the file's content atomically (write a sibling, fsync, rename over)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(encode_line(r))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
