"""Fixtures of the one-process sharded-export tests."""

from __future__ import annotations

import pytest

from tests.parallel.export_cases import use
from tests.parallel.fake_ranks import GROUP, FakeCollectives


@pytest.fixture
def fake(monkeypatch):
    """Three ranks (threads) of the train group, the export's torch.distributed and DTensor
    stood in for."""
    return use(monkeypatch, FakeCollectives(ranks=(0, 1, 2), group=GROUP))
