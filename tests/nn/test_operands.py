"""The operand table (`mxrl.nn.operands.OPERANDS`) against docs/design.md §4.5 (§7's table),
written out here by hand, and QLinear's GEMMs under every backward mode against the products of
the operands the table names, each built from mxrl.formats (not from mxrl.nn), bit for bit: the
reference path in fp32, the tensor-core path on the same operands rounded to bf16 (its CPU GEMM
is the fp32 product of bf16 values)."""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import decode_global_scale, dequantize, quantize
from mxrl.kernels import Gemm
from mxrl.nn import set_gemm
from mxrl.nn.operands import OPERANDS, GemmKind, Operand, form_of
from mxrl.recipe import Backward
from tests.nn.test_fp8_block_backward import _col as _fp8_block_col
from tests.nn.test_qmatmul import _deq_col_padded, act_kwargs, inputs, make_linear, weight_kwargs
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability

_FPROP = (("fwd_inp", "lp"), ("fwd_weight", "lp"))
# docs/design.md §4.5: GEMM -> backward mode -> ((operand, form), (operand, form))
DESIGN = {
    "fprop": {"high_precision": _FPROP, "dequantized": _FPROP, "quantized": _FPROP},
    "dgrad": {
        "high_precision": (("bwd_grad", "hp"), ("fwd_weight", "hp")),
        "dequantized": (("bwd_grad", "hp"), ("fwd_weight", "deq")),
        "quantized": (("bwd_grad", "row"), ("fwd_weight", "col")),
    },
    "wgrad": {
        "high_precision": (("bwd_grad", "hp"), ("fwd_inp", "hp")),
        "dequantized": (("bwd_grad", "hp"), ("fwd_inp", "deq")),
        "quantized": (("bwd_grad", "col"), ("fwd_inp", "col")),
    },
}


def test_the_table_is_the_designs():
    assert {(m, g) for m in Backward for g in GemmKind} == set(OPERANDS)
    assert len(OPERANDS) == 9
    for (mode, gemm), pair in OPERANDS.items():
        assert pair == DESIGN[gemm.value][mode.value], (mode, gemm)
        assert all(isinstance(op, Operand) for op, _ in pair)  # enums, not their strings
    assert [o.value for o in Operand] == ["fwd_inp", "fwd_weight", "bwd_grad"]
    assert [g.value for g in GemmKind] == ["fprop", "dgrad", "wgrad"]


def test_form_of():
    assert form_of(Backward.DEQUANTIZED, GemmKind.WGRAD, Operand.FWD_INPUT) == "deq"
    assert form_of(Backward.QUANTIZED, GemmKind.DGRAD, Operand.BWD_GRAD) == "row"
    with pytest.raises(KeyError):
        form_of(Backward.QUANTIZED, GemmKind.DGRAD, Operand.FWD_INPUT)


def _padded_cols(t, multiple):
    return torch.cat([t, torch.zeros(t.shape[0], -t.shape[1] % multiple)], dim=1)


def _operand(op, form, fmt, x, w, dy):
    """One (operand, form) of §4.5's table, in the tensor's own layout, from mxrl.formats."""
    t = {"fwd_inp": x, "fwd_weight": w, "bwd_grad": dy}[op]
    row_kw = weight_kwargs(fmt) if op == "fwd_weight" else act_kwargs(fmt)
    if form == "hp":
        return t
    if form in ("lp", "deq"):  # the forward's row-wise quantization
        return dequantize(quantize(t, fmt, **row_kw), global_scale=form == "deq")
    if form == "row":  # dy for the dgrad: blocks along N, a partial last one zero-padded
        if fmt == "fp8_block":
            padded = _padded_cols(t, 128)
            return dequantize(quantize(padded, fmt, block=(1, 128)))[:, : t.shape[1]]
        return dequantize(quantize(t, fmt))
    assert form == "col"
    if fmt == "fp8_block":  # w: the forward's square blocks; x, dy: 128 x 1 blocks
        return _operand(op, "deq", fmt, x, w, dy) if op == "fwd_weight" else _fp8_block_col(t).t()
    if op == "fwd_weight":
        return dequantize(quantize(t, fmt, axis=0))
    return _deq_col_padded(t)


def _expected(fmt, mode, x, w, dy, rounding=None):
    """y, dx, dw as the products of the operands OPERANDS names, each operand rounded by
    `rounding` (the tensor-core path's bf16) when given."""
    out = []
    for gemm in GemmKind:
        a, b = (_operand(op, form, fmt, x, w, dy) for op, form in OPERANDS[(mode, gemm)])
        if rounding is not None:
            a, b = a.to(rounding).float(), b.to(rounding).float()
        if gemm is GemmKind.FPROP:
            y = a @ b.t()
            s_x = decode_global_scale(quantize(x, fmt, **act_kwargs(fmt)))
            if s_x is not None:
                y = y * (s_x * decode_global_scale(quantize(w, fmt, **weight_kwargs(fmt))))
            out.append(y)
        else:
            out.append(a @ b if gemm is GemmKind.DGRAD else a.t() @ b)
    return out


def _wide(t):
    """Columns over 2^0..2^-14: a block along the rows mixes them (the small ones go
    subnormal), a block down a column does not, so row- and column-wise copies differ (E4M3
    rounding is otherwise scale-invariant)."""
    return t * 2.0 ** -torch.arange(t.shape[1]).remainder(15).float()


def _case(fmt, mode, gemm=None):
    q = make_linear(fmt, mode.value)
    set_gemm(q, gemm)
    with torch.no_grad():
        q.weight.copy_(_wide(q.weight))
    x, dy = inputs(rows=50)  # not whole blocks of tokens: the column-wise copies pad
    return q, _wide(x), _wide(dy[:, : q.out_features])


MODES = [
    (fmt, mode)
    for fmt in ("mxfp8", "nvfp4", "fp8_block")
    for mode in Backward
    if not (fmt == "nvfp4" and mode is Backward.QUANTIZED)
]


@pytest.mark.parametrize(("fmt", "mode"), MODES)
def test_reference_gemms_read_the_tables_operands(fmt, mode):
    q, x, dy = _case(fmt, mode)
    xg = x.clone().requires_grad_(True)
    y = q(xg)
    y.backward(dy)
    y_want, dx_want, dw_want = _expected(fmt, mode, x, q.weight.detach(), dy)
    assert_bytes_equal(y, y_want, "fprop")
    assert_bytes_equal(xg.grad, dx_want, "dgrad")
    assert_bytes_equal(q.weight.grad, dw_want, "wgrad")


@pytest.mark.parametrize(("fmt", "mode"), [m for m in MODES if m[0] != "fp8_block"])
def test_tensor_core_gemms_read_the_tables_operands_in_bf16(fmt, mode):
    """Off CUDA, each tensor-core GEMM is the fp32 product of its operands rounded to bf16 (the
    dequantized backward's NVFP4 weight included: deq rounded, not lp); block FP8 runs its own
    GEMMs there (tests/nn/test_fp8_block_backward.py)."""
    q, x, dy = _case(fmt, mode, Gemm.TENSOR_CORE)
    xg = x.clone().requires_grad_(True)
    q(xg).backward(dy)
    _, dx_want, dw_want = _expected(fmt, mode, x, q.weight.detach(), dy, rounding=torch.bfloat16)
    assert_bytes_equal(xg.grad, dx_want, "dgrad")
    assert_bytes_equal(q.weight.grad, dw_want, "wgrad")
