"""Fixtures of the run-record tests."""

from __future__ import annotations

import pytest

from mxrl.runs import RunRecord
from tests.runs.synthetic import write_run


@pytest.fixture
def make_run(tmp_path):
    root = tmp_path / "runs"

    def make(run_id: str, recipe: str | None = "nvfp4-dequantized", **kw) -> RunRecord:
        return write_run(root, run_id, recipe, **kw)

    make.root = root
    return make
