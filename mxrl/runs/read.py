"""The reading half of a run record (`RunRecord` takes these methods from `RunReading`): the
files of runs/<id>/ (docs/runs.md), what was written once (config.yaml, env.json, plan.json) and
the JSON-lines logs, read without modifying them. A line truncated by a killed writer or
unreadable is skipped and reported once (logging), as is a step logged twice.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mxrl.runs.jsonl import ReadResult, decode_float, read_jsonl
from mxrl.runs.yamlio import load_yaml

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"
ENV_FILE = "env.json"
METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
NOTES_FILE = "notes.md"
RUN_FILES = (CONFIG_FILE, PLAN_FILE, ENV_FILE, METRICS_FILE, EVENTS_FILE, NOTES_FILE)


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in (CONFIG_FILE, ENV_FILE))


class RunReading:
    """The reading half of `RunRecord` (it provides path, run_id, _cache and _reported)."""

    @property
    def config(self) -> dict[str, Any]:
        """config.yaml; {} when it is missing, unreadable or not a mapping (reading a record
        never fails on a hand-edited file)."""
        try:
            data = load_yaml(self.path / CONFIG_FILE)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    @property
    def env(self) -> dict[str, Any]:
        try:
            data = json.loads((self.path / ENV_FILE).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}

    @property
    def plan_json(self) -> str | None:
        try:
            return (self.path / PLAN_FILE).read_text()
        except FileNotFoundError:
            return None

    @property
    def recipe(self) -> str | None:
        """The recipe's name: config["recipe"] (the demo), config["rl"]["recipe"] (`mxrl train`
        files; a dict with a "name" gives the name), else plan.json's recipe_name; else None."""
        config = self.config
        recipe = config.get("recipe")
        rl = config.get("rl")
        if recipe is None and isinstance(rl, Mapping):
            recipe = rl.get("recipe")
        if isinstance(recipe, Mapping):
            recipe = recipe.get("name")
        if recipe is None and self.plan_json is not None:
            with contextlib.suppress(json.JSONDecodeError, AttributeError):
                recipe = json.loads(self.plan_json).get("recipe_name")
        return None if recipe is None else str(recipe)

    def _read(self, name: str) -> ReadResult:
        path = self.path / name
        try:
            st = path.stat()
            key = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            return ReadResult()
        cached = self._cache.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        result = read_jsonl(path)
        for problem in result.problems:
            self._report(problem, problem)
        self._cache[name] = (key, result)
        return result

    def _report(self, key: str, message: str) -> None:
        if key not in self._reported:
            logger.warning("run %s: %s", self.run_id, message)
        self._reported[key] = message

    @property
    def problems(self) -> list[str]:
        """What the readers skipped (truncated or unreadable lines, duplicate steps)."""
        self.metrics()
        self.events()
        return sorted(self._reported.values())

    def metrics(self) -> list[dict[str, Any]]:
        """One dict per step, by step, {"step": int, key: float, ...}. A step logged twice (a
        resume without truncate_after) keeps its last line, and is reported once."""
        rows: dict[int, dict[str, Any]] = {}
        duplicates = 0
        for r in self._read(METRICS_FILE).records:
            step = r.get("step")
            if isinstance(step, bool) or not isinstance(step, int):
                continue
            duplicates += step in rows
            rows[step] = {k: (v if k == "step" else _as_float(v)) for k, v in r.items()}
        if duplicates:
            self._report(
                "duplicate steps",
                f"{METRICS_FILE}: {duplicates} step(s) logged more than once (kept the last); "
                "call truncate_after(step) when resuming",
            )
        return [rows[step] for step in sorted(rows)]

    def events(self, type: str | None = None) -> list[dict[str, Any]]:
        """The events in file order, all or of one type (non-finite numbers stay strings, as in
        QuantizationEvent.to_dict)."""
        events = self._read(EVENTS_FILE).records
        return [dict(e) for e in events if type is None or e.get("type") == type]

    def span(self) -> tuple[float, float] | None:
        """(first, last) of the run's event times, POSIX seconds: when it wrote its first and
        last events (a GRPO run: its first and last syncs); None without a timed event."""
        times = []
        for event in self.events():
            with contextlib.suppress(KeyError, TypeError, ValueError):
                times.append(dt.datetime.fromisoformat(str(event["time"])).timestamp())
        return (min(times), max(times)) if times else None

    def notes(self) -> str:
        try:
            return (self.path / NOTES_FILE).read_text()
        except FileNotFoundError:
            return ""


def _as_float(value: Any) -> float:
    value = decode_float(value)
    if isinstance(value, bool | int | float):
        return float(value)
    return math.nan  # a hand-edited line with a non-number: visible as a gap, not a crash
