"""QWeight (mxrl/nn/weight.py): each operand is the formats API's bytes in the asked dtype, what
it keeps is exactly what was held, and each GEMM path holds what docs/nn.md says. Expected
values are built from mxrl.formats directly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mxrl.formats import QTensor, decode_global_scale, dequantize, quantize
from mxrl.kernels import Gemm
from mxrl.nn import QExperts, QWeight, set_gemm
from mxrl.nn.operands import Form
from tests.nn.test_qmatmul import _expert_specs, _experts, inputs, make_linear, spec, weight_kwargs
from tests.numerics import assert_bytes_equal

F32, BF16 = torch.float32, torch.bfloat16


def _weight(fmt, shape=(96, 128), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 0.05


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8_block"])
def test_operands_are_the_formats_bytes_and_not_kept(fmt):
    w = _weight(fmt)
    qw = QWeight.from_master(w, spec(fmt))
    q = quantize(w, fmt, **weight_kwargs(fmt))
    assert_bytes_equal(qw.q.qdata, q.qdata, "codes")
    lp, deq = dequantize(q, global_scale=False), dequantize(q)
    for dtype in (F32, BF16):
        assert_bytes_equal(qw.operand(Form.LP, dtype), lp.to(dtype), f"lp {dtype}")
        assert_bytes_equal(qw.operand(Form.DEQ, dtype), deq.to(dtype), f"deq {dtype}")
    want_s = decode_global_scale(q)
    assert (qw.s_dec is None) == (want_s is None)
    if want_s is not None:
        assert_bytes_equal(qw.s_dec, want_s, "s_dec")
    assert qw.held == {} and qw.col() is None  # nothing derived kept, no column-wise source
    with pytest.raises(ValueError, match="no hp operand"):
        qw.operand(Form.HP, F32)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_hold_keeps_what_it_derived_and_operand_returns_it(fmt):
    qw = QWeight.from_master(_weight(fmt), spec(fmt)).hold(Form.LP, Form.DEQ, dtype=F32)
    lp, deq = qw.operand(Form.LP, F32), qw.operand(Form.DEQ, F32)
    assert len(qw.held) == 2 and all(v is lp or v is deq for v in qw.held.values())
    assert qw.operand(Form.LP, F32) is lp  # held: the same tensor, not a new one
    # without a global scale deq is lp, one tensor; NVFP4's deq carries the global scale
    assert (deq is lp) == (fmt == "mxfp8")
    assert qw.operand(Form.LP, BF16) is not qw.operand(Form.LP, BF16)  # bf16: not held


def test_mxfp8_column_copy_is_made_once_from_the_master():
    w = _weight("mxfp8")
    want = quantize(w, "mxfp8", axis=0)
    held = QWeight.from_master(w, spec("mxfp8"), colwise=True).hold(Form.COL, dtype=F32)
    assert list(held.held) == ["col:torch.float32"]  # the fp32 values alone, not the QTensor
    assert_bytes_equal(held.operand(Form.COL, F32), dequantize(want), "held col")
    lazy = QWeight.from_master(w, spec("mxfp8"), colwise=True)
    assert lazy.held == {}  # made when first asked for
    assert_bytes_equal(lazy.operand(Form.COL, BF16), dequantize(want).to(BF16), "col bf16")
    col = lazy.col()
    assert isinstance(col, QTensor) and lazy.col() is col  # then held
    assert_bytes_equal(col.qdata, want.qdata, "col codes")
    assert all(isinstance(v, QTensor) for v in lazy.held.values())


def test_fp8_block_column_copy_is_the_forward_blocks_transposed():
    w = _weight("fp8_block", (128, 256))
    qw = QWeight.from_master(w, spec("fp8_block", shape=(128, 256)), colwise=True)
    want = quantize(w.t().contiguous(), "fp8_block", block=(128, 128))
    assert_bytes_equal(qw.col().qdata, want.qdata, "codes of w^T")
    assert_bytes_equal(qw.col().scale, want.scale, "scales of w^T")


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_for_expert_views_one_experts_bytes_and_held_operands(fmt):
    experts = _experts()
    gu_spec = _expert_specs(fmt)[0]
    w3 = experts.gate_up_proj.detach()
    colwise = fmt == "mxfp8"
    lazy = QWeight.from_master(w3, gu_spec, colwise=colwise)
    held = QWeight.from_master(w3, gu_spec, colwise=colwise).hold(Form.LP, Form.DEQ, dtype=F32)
    q = lazy.q
    for e in range(w3.shape[0]):
        for qw in (lazy, held):
            one = qw.for_expert(e)
            lp = one.operand(Form.LP, F32)
            assert_bytes_equal(lp, dequantize(q, global_scale=False)[e], f"lp {e}")
            assert_bytes_equal(one.operand(Form.DEQ, F32), dequantize(q)[e], f"deq {e}")
            assert lp.shape == w3.shape[1:]
        if colwise:
            col = dequantize(quantize(w3, "mxfp8", axis=-2))[e]
            assert_bytes_equal(lazy.for_expert(e).operand(Form.COL, F32), col, f"col {e}")


def test_fields_are_the_held_tensors():
    """A QWeight's dataclass fields are the tensors it holds (what the engine's loads copy in
    place): the bytes, the decode scale, the held operands; not its backend or col source."""
    assert [f.name for f in dataclasses.fields(QWeight)] == ["q", "s_dec", "held"]


@pytest.mark.parametrize(
    ("fmt", "mode"), [("mxfp8", "quantized"), ("nvfp4", "dequantized"), ("fp8_block", "quantized")]
)
def test_each_path_holds_what_docs_nn_says(fmt, mode):
    """After a forward and backward: the tensor-core path's QWeight holds packed bytes only (no
    bf16 or fp32 copy); the reference path's holds fp32 LP, DEQ and, for MXFP8's quantized
    backward, COL."""
    q = make_linear(fmt, mode)
    x, dy = inputs()
    for gemm in (Gemm.TENSOR_CORE, Gemm.REFERENCE):
        set_gemm(q, gemm)
        q(x.clone().requires_grad_(True)).backward(dy)
        held = q.qweight(gemm).held
        if gemm is Gemm.TENSOR_CORE:
            assert all(isinstance(v, QTensor) for v in held.values()), held.keys()
            assert set(held) == ({"col"} if fmt == "mxfp8" else set())
        else:
            forms = ["deq", "lp"] + (["col"] if fmt == "mxfp8" else [])
            assert sorted(held) == sorted(f"{f}:torch.float32" for f in forms)
            assert all(v.dtype == F32 for v in held.values())


def test_one_cache_per_weight_rebuilt_for_the_other_path():
    """QLinear keeps one cache: the same QWeight while the weight and path stay, a new one for
    the other path; QExperts one per projection."""
    q = make_linear("mxfp8", "quantized")
    tc = q.qweight(Gemm.TENSOR_CORE)
    assert q.qweight(Gemm.TENSOR_CORE) is tc
    ref = q.qweight(Gemm.REFERENCE)
    assert ref is not tc and q.qweight(Gemm.REFERENCE) is ref
    qe = QExperts.from_experts(_experts(), *_expert_specs("mxfp8"), "quantized")
    assert set(qe._caches) == {"gate_up", "down"}
    assert qe.qweight("down", Gemm.REFERENCE) is qe.qweight("down", Gemm.REFERENCE)
