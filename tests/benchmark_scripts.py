"""Loading a script of benchmarks/ as a module, for the tests that run it shrunk on the CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str, mp: pytest.MonkeyPatch, module_name: str | None = None) -> ModuleType:
    """benchmarks/<name>.py as a module (`module_name`, default `name`), with benchmarks/ on
    sys.path while `mp` lasts: the scripts import benchmarks/common.py."""
    mp.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(module_name or name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
