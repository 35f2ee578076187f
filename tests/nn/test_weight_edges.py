"""Edges of one quantized weight (mxrl/nn/weight.py: QWeight, its column-wise copy, experts'
views, WeightCache), each expectation from mxrl.formats or worked out by hand: the backend every
kernel call is given, a column-wise copy made once and refused after an in-place write, what
`hold` keeps, an expert's view of a made column copy and of its per-expert global scale, and
the cache's key (data pointer, shape, kind, the weights epoch). The layers that build it:
tests/nn/test_qlinear_edges.py."""

from __future__ import annotations

import pytest
import torch

import mxrl.nn.weight as weight
from mxrl.formats import QTensor, decode_global_scale, dequantize, quantize
from mxrl.kernels import Backend
from mxrl.nn import QWeight, WeightCache, weights_changed
from mxrl.nn.operands import Form
from tests.nn.test_qmatmul import _expert_specs, spec
from tests.numerics import assert_bytes_equal

F32, BF16 = torch.float32, torch.bfloat16


def _w(shape=(64, 32), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 0.05


def test_every_kernel_call_runs_on_the_weights_backend(monkeypatch):
    """The row-wise copy, the column-wise copy and each operand: stand-ins record the backend
    each call is given and run the reference (TRITON is only a marker here: it needs CUDA)."""
    seen = []
    real_q, real_deq = weight.kernel_quantize, weight.kernel_dequantize

    def quantize_(t, fmt, *, backend=None, **kw):
        seen.append(("quantize", kw.get("axis", -1), backend))
        return real_q(t, fmt, backend=Backend.REFERENCE, **kw)

    def dequantize_(q, *, backend=None, **kw):
        seen.append(("dequantize", kw["dtype"], backend))
        return real_deq(q, backend=Backend.REFERENCE, **kw)

    monkeypatch.setattr(weight, "kernel_quantize", quantize_)
    monkeypatch.setattr(weight, "kernel_dequantize", dequantize_)
    w = _w()
    qw = QWeight.from_master(w, spec("mxfp8", shape=(64, 32)), colwise=True, backend="triton")
    assert qw.backend == Backend.TRITON
    lp = qw.operand(Form.LP, BF16)
    col = qw.operand(Form.COL, F32)
    assert seen == [
        ("quantize", -1, Backend.TRITON),
        ("dequantize", BF16, Backend.TRITON),
        ("quantize", 0, Backend.TRITON),
        ("dequantize", F32, Backend.TRITON),
    ]
    assert_bytes_equal(lp, dequantize(quantize(w, "mxfp8"), global_scale=False).to(BF16), "lp")
    assert_bytes_equal(col, dequantize(quantize(w, "mxfp8", axis=0)), "col")


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_weight_from_the_contract_bytes_has_no_column_copy_and_keeps_its_backend(fmt):
    """The rollout engine's weights: the bytes as given, their decode scale, the backend its
    bf16 operands are written on, nothing held and no column-wise source."""
    q = quantize(_w(), fmt)
    qw = QWeight.from_qtensor(q, backend=Backend.TRITON)
    assert qw.q is q and qw.backend is Backend.TRITON
    assert qw.held == {} and qw.col() is None
    want = decode_global_scale(q)
    assert (qw.s_dec is None) == (want is None)
    if want is not None:
        assert_bytes_equal(qw.s_dec, want, "s_dec")
    assert QWeight.from_qtensor(q).backend is Backend.REFERENCE


def test_the_column_copy_is_refused_after_an_in_place_write_and_made_before_one():
    w = _w()
    s = spec("mxfp8", shape=(64, 32))
    fresh = QWeight.from_master(w, s, colwise=True)
    assert_bytes_equal(fresh.col().qdata, quantize(w, "mxfp8", axis=0).qdata, "col codes")
    stale = QWeight.from_master(w, s, colwise=True)
    w.add_(1.0)  # an optimizer step between the forward and the backward
    with pytest.raises(RuntimeError, match="written in place"):
        stale.col()
    assert fresh.col() is fresh.col()  # made before the write: held, not made again


def _counting_col(q):
    calls = []

    def make():
        calls.append(1)
        return q

    return calls, make


def test_hold_derives_col_without_keeping_it_unless_col_had_made_it():
    w = _w()
    col_q = quantize(w, "mxfp8", axis=0)
    calls, make = _counting_col(col_q)
    qw = QWeight(quantize(w, "mxfp8"), col_fn=make)
    assert qw.hold(Form.COL, dtype=F32) is qw  # returns self
    assert list(qw.held) == ["col:torch.float32"] and len(calls) == 1
    assert_bytes_equal(qw.held["col:torch.float32"], dequantize(col_q), "held col")
    made = QWeight(quantize(w, "mxfp8"), col_fn=make)
    assert made.col() is col_q and len(calls) == 2
    made.hold(Form.COL, dtype=BF16)  # col had made it: the held QTensor, not a new one
    assert len(calls) == 2 and set(made.held) == {"col", "col:torch.bfloat16"}
    bare = QWeight(quantize(w, "mxfp8"))
    with pytest.raises(
        AssertionError, match=r"^quantized backward needs the column-wise weight copy$"
    ):
        bare.hold(Form.COL, dtype=F32)


def test_deq_is_lp_without_a_global_scale():
    """Without a global scale deq and lp have the same values: the deq operand is the lp
    tensor itself in any dtype (one held or kept tensor); with one (NVFP4) they differ."""
    q = quantize(_w(), "mxfp8")
    qw = QWeight(q).hold(Form.LP, dtype=BF16)
    lp16 = qw.operand(Form.LP, BF16)
    deq16 = qw.operand(Form.DEQ, BF16)
    assert deq16 is lp16
    assert_bytes_equal(deq16, dequantize(q).to(BF16), "deq bf16")
    kept = QWeight(q).keep_operands(Form.DEQ)
    assert kept.keep == {Form.LP}
    assert kept.operand(Form.DEQ, BF16) is kept.operand(Form.LP, BF16)
    assert list(kept.held) == [f"lp:{BF16}"]
    held = QWeight(q).hold(Form.LP, dtype=F32)
    assert held.operand(Form.DEQ, F32) is held.operand(Form.LP, F32)
    nv = quantize(_w(), "nvfp4")
    nvw = QWeight(nv).hold(Form.LP, dtype=F32)
    assert_bytes_equal(nvw.operand(Form.DEQ, F32), dequantize(nv), "nvfp4 deq")
    assert_bytes_equal(nvw.s_dec, decode_global_scale(nv), "s_dec")
    given = torch.tensor(0.25)
    assert QWeight(nv, s_dec=given).s_dec is given  # a given decode scale is kept


def test_an_expert_views_its_bytes_its_global_scale_and_a_made_column_copy():
    w3 = _w((3, 64, 32))
    gu_spec = _expert_specs("mxfp8", e=3, h=32, i=32)[0]
    qw = QWeight.from_master(w3, gu_spec, colwise=True)
    made = qw.col()
    want_col = quantize(w3, "mxfp8", axis=1)
    for e in range(3):
        one = qw.for_expert(e)
        assert isinstance(one.held["col"], QTensor) and one.col() is one.held["col"]
        assert one.col().axis == -2 and one.col().shape == (64, 32)
        assert_bytes_equal(one.col().qdata, want_col.qdata[e], f"col codes {e}")
        assert_bytes_equal(one.operand(Form.COL, F32), dequantize(want_col)[e], f"col {e}")
    assert qw.col() is made
    # NVFP4 with one global scale per expert ([E, 1, 1]): expert e's is the [1, 1] of its own
    amax = w3.abs().amax(dim=(1, 2), keepdim=True)
    nv = quantize(w3, "nvfp4", global_amax=amax)
    nvw = QWeight(nv)
    for e in range(3):
        one = nvw.for_expert(e)
        want = decode_global_scale(quantize(w3[e], "nvfp4", global_amax=amax[e]))
        assert_bytes_equal(one.s_dec, want, f"s_dec {e}")
        assert_bytes_equal(one.q.global_scale, nv.global_scale[e], f"global scale {e}")
        assert_bytes_equal(one.operand(Form.DEQ, F32), dequantize(nv)[e], f"deq {e}")
    # no column-wise source: an expert has none either; each keeps the weight's backend
    bare = QWeight(quantize(w3, "mxfp8"), backend=Backend.TRITON)
    assert bare.for_expert(2).col() is None and bare.for_expert(2).backend is Backend.TRITON
    # one global scale for all experts ([]): each expert keeps it as it is
    flat = QWeight(quantize(w3, "nvfp4"))
    assert flat.for_expert(1).s_dec is flat.s_dec


def test_an_expert_of_a_hand_built_column_copy_counts_its_axis_from_the_end():
    """A QTensor whose axis is given from the end (-2 of a 3-D copy) keeps it: -2 of the
    expert's 2-D copy too, the same blocks."""
    w3 = _w((2, 64, 32))
    q = quantize(w3, "mxfp8", axis=1)
    neg = QTensor(q.qdata, q.scale, q.fmt, q.shape, axis=-2)
    for e in range(2):
        one = weight._expert(neg, e)
        assert one.axis == -2
        assert_bytes_equal(dequantize(one), dequantize(quantize(w3[e], "mxfp8", axis=0)), "e")


def _builds():
    built = []

    def build():
        built.append(object())
        return built[-1]

    return built, build


def test_the_cache_rebuilds_for_a_new_buffer_shape_kind_or_epoch_and_after_clear():
    w = torch.nn.Parameter(torch.ones(4, 4))
    cache, (built, build) = WeightCache(), _builds()
    first = cache.get((w,), build, kind="a")
    assert cache.get((w,), build, kind="a") is first and len(built) == 1
    assert cache.get((w,), build, kind="b") is not first and len(built) == 2  # another kind
    assert cache.get((w,), build, kind="a") is not first and len(built) == 3  # one slot
    w.data = torch.ones(4, 4)  # a new buffer: its version counter starts again
    cache.get((w,), build, kind="a")
    assert len(built) == 4
    w.data = w.data.view(2, 8)  # the same buffer in another shape
    cache.get((w,), build, kind="a")
    assert len(built) == 5
    weights_changed()
    cache.get((w,), build, kind="a")
    weights_changed()  # every call moves the epoch, not just the first
    cache.get((w,), build, kind="a")
    assert len(built) == 7
    cache.clear()
    cache.get((w,), build, kind="a")
    assert len(built) == 8 and cache.get((w,), build, kind="a") is built[-1]


def test_the_cache_watches_every_tensor_it_was_built_from():
    gate, up = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4, 4))
    cache, (built, build) = WeightCache(), _builds()
    cache.get((gate, up), build)
    with torch.no_grad():
        up.mul_(2.0)  # the partner's write: the shared global scale changes
    cache.get((gate, up), build)
    assert len(built) == 2


def test_kept_operands_are_the_made_bytes_and_only_the_named_forms():
    nv = quantize(_w(), "nvfp4")
    qw = QWeight(nv).keep_operands(Form.DEQ)
    deq = qw.operand(Form.DEQ, BF16)
    assert qw.operand(Form.DEQ, BF16) is deq, "kept: made once"
    assert_bytes_equal(deq, dequantize(nv).to(BF16), "kept deq")
    lp = qw.operand(Form.LP, BF16)
    assert qw.operand(Form.LP, BF16) is not lp, "not named: made per call"
    assert_bytes_equal(lp, dequantize(nv, global_scale=False).to(BF16), "lp")
    assert list(qw.held) == [f"deq:{BF16}"]
    master = _w()
    for keep, kept in (((), False), ((Form.HP,), True)):
        w = QWeight(quantize(master, "mxfp8")).keep_operands(*keep)
        hp = w.master_operand(master, BF16)
        assert_bytes_equal(hp, master.to(BF16), "hp")
        assert (w.master_operand(master, BF16) is hp) is kept
