"""The order of an engine load (`WeightLoading.load_weights`): the checksums queued before the
records are checked against the plan, the update staged while the device computes them (up to
`STAGE_AHEAD_BYTES` of derived tensors), one wait, then the writes; on the stand-in engine of
tests/engine/test_loading_edges.py, whose CPU GEMMs derive fp32 operands when they stage."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import torch

import mxrl.engine.loading as loading
from mxrl.engine.loading import _fresh_bytes, _leaves
from tests.engine.test_loading_edges import (
    BIAS,
    DOWN,
    EMBED,
    GATE_UP,
    NORM,
    QB,
    SHAPES,
    Host,
    Q,
    _loaded,
    _records,
    _refused,
    _u8,
)  # fmt: skip


def _load_traced(host: Host, monkeypatch) -> list[str]:
    """Load seed 1's records into `host`, listing in order: each record's staging, the
    queued checksums, each check against the plan, the wait for the checks of the bytes and
    the `before_write` call."""
    events: list[str] = []
    stage, check, result = host._stage, loading.check_record, loading._Verification.result

    class Queued(loading.PendingChecksums):
        def __init__(self, names, values):
            events.append("checksums queued")
            super().__init__(names, values)

    def waited(self):
        events.append("wait")
        return result(self)

    monkeypatch.setattr(loading, "PendingChecksums", Queued)
    monkeypatch.setattr(
        loading, "check_record", lambda r, *a: (events.append("check"), check(r, *a))[1]
    )
    monkeypatch.setattr(loading._Verification, "result", waited)
    monkeypatch.setattr(host, "_stage", lambda n, v: (events.append(f"stage {n}"), stage(n, v))[1])
    host.load_weights(_records(1), host.plan.hash(), before_write=lambda: events.append("write"))
    return events


def test_a_reload_is_staged_while_the_checksums_are_computed(monkeypatch):
    """The engine queues the update's checksums before it checks the records against the plan
    (host work the device's checksums overlap), stages every record before it waits for them,
    and writes after: each record staged once, the bytes of a plain reload."""
    host = _loaded()
    events = _load_traced(host, monkeypatch)
    staged = [f"stage {n}" for n in SHAPES]
    assert events == ["checksums queued", *["check"] * len(SHAPES), *staged, "wait", "write"]
    assert _same_bytes(host, _loaded(1))


def test_staging_ahead_stops_at_its_budget_of_derived_bytes(monkeypatch):
    """What the engine derives when it stages (here the CPU's fp32 operands) is held for every
    record staged ahead of the wait, so only up to STAGE_AHEAD_BYTES of it: with a budget of 0
    the first record (the embedding, bf16 -> fp32: derived) is staged ahead and the rest one by
    one after the write began, each freed before the next, copied into the held buffers as
    well (the same storage, no graph dropped). Same bytes."""
    monkeypatch.setattr(loading, "STAGE_AHEAD_BYTES", 0)
    host = _loaded()
    ptrs = [t.data_ptr() for n in SHAPES for t in _leaves(host._installed(n)) if t is not None]
    events = _load_traced(host, monkeypatch)
    first, *rest = [f"stage {n}" for n in SHAPES]
    assert events == ["checksums queued", *["check"] * len(SHAPES), first, "wait", "write", *rest]
    assert _same_bytes(host, _loaded(1)) and host.dropped == 1
    assert ptrs == [
        t.data_ptr() for n in SHAPES for t in _leaves(host._installed(n)) if t is not None
    ]


def test_the_budget_counts_every_record_staged_ahead(monkeypatch):
    """The derived bytes add up over the records: with a budget of the embedding's and
    q_proj's together (bf16 -> fp32: 512 bytes; q_proj's fp32 operand, 4096: MXFP8 has no
    global scale, so its DEQ operand is its LP one), the norm is staged ahead too (the budget
    is not passed yet when it comes), and then, past it, the fp32 router bias, which derives
    nothing, and the rest wait for the write."""
    monkeypatch.setattr(loading, "STAGE_AHEAD_BYTES", 512 + 4096)
    host = _loaded()
    events = _load_traced(host, monkeypatch)
    ahead, later = [f"stage {n}" for n in (EMBED, Q, NORM)], [BIAS, QB, GATE_UP, DOWN]
    assert events == [
        "checksums queued", *["check"] * len(SHAPES), *ahead, "wait", "write",
        *[f"stage {n}" for n in later],
    ]  # fmt: skip
    assert _same_bytes(host, _loaded(1))


def test_names_of_a_str_subclass_are_checked_before_their_checksums(monkeypatch):
    """Names that are not exactly str (numpy's str_, a str subclass) are checked against the
    plan first, then checksummed: the update loads as with plain names."""
    host = _loaded()
    records = [dataclasses.replace(r, name=np.str_(r.name)) for r in _records(1)]
    assert all(type(r.name) is np.str_ for r in records)
    events: list[str] = []
    check, queued = loading.check_record, loading.PendingChecksums
    monkeypatch.setattr(
        loading, "check_record", lambda r, *a: (events.append("check"), check(r, *a))[1]
    )
    monkeypatch.setattr(
        loading, "PendingChecksums", lambda n, v: (events.append("queued"), queued(n, v))[1]
    )
    host.load_weights(records, host.plan.hash())
    assert events == [*["check"] * len(SHAPES), "queued"]
    assert _same_bytes(host, _loaded(1))


def test_fresh_bytes_counts_what_staging_derived():
    """A staged value's own tensors cost nothing; a derived one its storage's bytes, once."""
    value = torch.zeros(8, dtype=torch.bfloat16)
    derived = torch.zeros(8)
    assert _fresh_bytes((value, value), value) == 0
    assert _fresh_bytes((value, {"w": derived, "v": derived[2:]}), value) == 32


def test_a_record_that_is_no_tensor_is_refused_by_the_plan_check():
    """The checksums are queued before the plan checks only when every record is a name and a
    tensor: a value of another kind is refused by the check (ValueError naming the tensor), not
    by the checksum's TypeError; nothing is written."""
    host = _loaded()
    for name in (NORM, Q):  # a plain and a quantized tensor of the plan
        bad = [dataclasses.replace(r, value=[1.0]) if r.name == name else r for r in _records(1)]
        _refused(host, bad, re.escape(name) + ": a record's value is a QTensor or a tensor")


def _same_bytes(a: Host, b: Host) -> bool:
    """The same hashes and held bytes (storages aside)."""
    held = [[t for n in SHAPES for t in _leaves(h._installed(n)) if t is not None] for h in (a, b)]
    return a.hashes == b.hashes and all(
        torch.equal(_u8(x), _u8(y)) for x, y in zip(*held, strict=True)
    )
