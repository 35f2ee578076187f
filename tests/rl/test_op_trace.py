"""The op tracer that found the golden run's processor-dependent op (tests/golden/README.md):
it names an op whose inputs agree with the reference trace and whose outputs do not."""

from __future__ import annotations

import gzip

import torch

from tests.rl.op_trace import OpTrace


def _trace(path, fn, reference=None):
    with gzip.open(path, "wt") as out, OpTrace(out, reference) as trace:
        fn()
    with gzip.open(path, "rt") as f:
        return trace, [line.rstrip("\n").split("\t") for line in f]


def test_the_tracer_names_the_op_with_same_inputs_and_other_outputs(tmp_path):
    x = torch.arange(1.0, 9.0)

    def run():
        y = torch.empty_like(x)  # uninitialized: zero-filled, so its hash is deterministic
        torch.sqrt(x, out=y)
        (y * 2).sum()

    _, ref = _trace(tmp_path / "a.gz", run)
    again, lines = _trace(tmp_path / "b.gz", run, ref)
    assert [r[1:] for r in lines] == [r[1:] for r in ref]  # deterministic, empty_like included
    assert again.culprits == []
    # the reference machine's sqrt gave other bytes: that op, and only it, is named
    i = next(k for k, r in enumerate(ref) if "sqrt" in r[1])
    ref[i] = [*ref[i][:3], "0" * 12]
    found, _ = _trace(tmp_path / "c.gz", run, ref)
    assert [c["op"] for c in found.culprits] == [i]
    assert "sqrt" in found.culprits[0]["func"]
    assert torch.equal(found.culprits[0]["inputs"][0][0], x)
