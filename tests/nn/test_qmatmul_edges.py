"""Edges of the reference quantized GEMM (mxrl/nn/paths/reference.py) and its operand table
(mxrl/nn/operands.py), each expectation worked out by hand or written from the formats' spec
(an MXFP8 element is an E4M3 code times 2^k, k the block's E8M0 exponent): the output scale's
layout, gradients only for the inputs that need them, the output's dtype, the backend every
quantization of a backward runs on, and each operand made once for both backward GEMMs."""

from __future__ import annotations

import pytest
import torch

import mxrl.nn.paths.reference as qmatmul
import mxrl.nn.weight as weight
from mxrl.kernels import Backend
from mxrl.nn.operands import BackwardOperands, Form, GemmKind, Operand
from mxrl.nn.paths.reference import QMatmul, output_scale
from mxrl.nn.weight import QWeight
from mxrl.recipe import Backward
from tests.nn.test_qmatmul import spec
from tests.numerics import assert_bytes_equal


def test_output_scale_keeps_none_and_a_scalar_and_lays_a_per_row_scale_along_the_outputs():
    assert output_scale(None) is None
    s = torch.tensor(0.5)
    assert output_scale(s) is s  # [] multiplies every output as it is
    per_row = torch.tensor([[1.0], [2.0], [4.0]])  # [N, 1], one per output feature
    assert_bytes_equal(output_scale(per_row), torch.tensor([[1.0, 2.0, 4.0]]), "[1, N]")


def _small(rows=2, k=32, n=32):
    """x [rows, K], w [N, K], dy [rows, N] of small integers: every value is an E4M3 code
    (integers up to 16 are exact in E4M3) and every product and sum is exact in fp32, so the
    quantized forward is x @ w^T itself and each gradient the plain float64 product."""
    x = (torch.arange(rows * k).reshape(rows, k) % 5 - 2).float()
    w = (torch.arange(n * k).reshape(n, k) % 7 - 3).float()
    dy = (torch.arange(rows * n).reshape(rows, n) % 3 - 1).float()
    return x, w, dy


def _apply(x, w, mode="high_precision", backend=Backend.REFERENCE, fmt="mxfp8"):
    s = spec(fmt, shape=tuple(w.shape))
    wq = QWeight.from_master(w, s, colwise=mode == "quantized")
    return QMatmul.apply(x, w, wq, s, Backward(mode), backend)


@pytest.mark.parametrize("mode", ["high_precision", "dequantized", "quantized"])
def test_only_the_input_that_needs_a_gradient_gets_one(mode):
    x, w, dy = _small()
    want_dx = (dy.double() @ w.double()).float()
    want_dw = (dy.double().t() @ x.double()).float()
    xg, wf = x.clone().requires_grad_(True), w.clone()
    y = _apply(xg, wf, mode)
    assert_bytes_equal(y.detach(), (x.double() @ w.double().t()).float(), "y")
    y.backward(dy)
    assert_bytes_equal(xg.grad, want_dx, "dx with w frozen")
    xf, wg = x.clone(), w.clone().requires_grad_(True)
    _apply(xf, wg, mode).backward(dy)
    assert_bytes_equal(wg.grad, want_dw, "dw with x frozen")


def test_a_bf16_input_gives_a_bf16_output_and_gradient():
    x, w, dy = _small()
    xg = x.to(torch.bfloat16).requires_grad_(True)
    y = _apply(xg, w.clone().requires_grad_(True))
    assert_bytes_equal(y.detach(), (x.double() @ w.double().t()).to(torch.bfloat16), "y")
    y.backward(dy.to(torch.bfloat16))
    assert_bytes_equal(xg.grad, (dy.double() @ w.double()).to(torch.bfloat16), "dx")


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_block"])
def test_every_quantization_runs_on_the_backend_the_layer_was_given(fmt, monkeypatch):
    """The forward's activation and the quantized backward's copies of dy and x (module
    docstring: quantized on the forward's backend). Stand-ins record the backend each call is
    given and quantize on the reference (TRITON is only a marker here: it needs CUDA)."""
    seen = []

    def quantize(t, f, *, backend=None, **kw):
        seen.append(("quantize", backend))
        return real_quantize(t, f, backend=Backend.REFERENCE, **kw)

    def both(t, *, backend=None, **kw):
        seen.append(("both", backend))
        return real_both(t, backend=Backend.REFERENCE, **kw)

    real_quantize, real_both = qmatmul.kernel_quantize, qmatmul.quantize_mxfp8_both
    monkeypatch.setattr(qmatmul, "kernel_quantize", quantize)
    monkeypatch.setattr(qmatmul, "quantize_mxfp8_both", both)
    k = 128 if fmt == "fp8_block" else 32
    x, w, dy = _small(rows=3, k=k, n=5 if fmt == "fp8_block" else 32)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    _apply(xg, wg, "quantized", Backend.TRITON, fmt).backward(dy)
    # the forward's x; then dy (both copies at once for MXFP8, row then column for block FP8)
    # and x's column-wise copy
    calls = ["quantize", "both", "quantize"] if fmt == "mxfp8" else ["quantize"] * 4
    assert [c for c, _ in seen] == calls
    assert all(b is Backend.TRITON for _, b in seen), seen
    if fmt == "mxfp8":  # small integers: every MXFP8 copy is exact (block FP8's fp32 scales
        # amax / 448 are not powers of two, so its copies round)
        assert_bytes_equal(xg.grad, (dy.double() @ w.double()).float(), "dx")
        assert_bytes_equal(wg.grad, (dy.double().t() @ x.double()).float(), "dw")


@pytest.mark.parametrize(
    ("fmt", "mode"), [("mxfp8", "quantized"), ("nvfp4", "dequantized"), ("fp8_block", "quantized")]
)
def test_the_reference_gemms_read_the_weights_held_fp32_operands_and_make_none(
    fmt, mode, monkeypatch
):
    """The reference path holds its weight's fp32 LP, DEQ (and MXFP8's COL) from the build to
    the next optimizer step (docs/nn.md): a forward and backward read those and derive no
    weight operand again, so the weight's kernels must not run."""
    k = 128 if fmt == "fp8_block" else 32
    x, w, dy = _small(rows=3, k=k, n=32)
    s = spec(fmt, shape=tuple(w.shape))
    colwise = fmt == "mxfp8" and mode == "quantized"
    forms = (Form.LP, Form.DEQ, *([Form.COL] if colwise else []))
    wq = QWeight.from_master(w, s, colwise=colwise).hold(*forms, dtype=torch.float32)

    def refuse(*args, **kwargs):
        raise AssertionError("a held weight operand was derived again")

    monkeypatch.setattr(weight, "kernel_dequantize", refuse)
    monkeypatch.setattr(weight, "kernel_quantize", refuse)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = QMatmul.apply(xg, wg, wq, s, Backward(mode), Backend.REFERENCE)
    y.backward(dy)
    assert xg.grad is not None and wg.grad is not None
    if fmt == "mxfp8":  # small integers: every copy exact
        assert_bytes_equal(xg.grad, (dy.double() @ w.double()).float(), "dx")
        assert_bytes_equal(wg.grad, (dy.double().t() @ x.double()).float(), "dw")


def test_each_operand_is_made_once_for_both_backward_gemms():
    """dy in one form is one tensor for the dgrad and the wgrad: its maker runs once, on the
    first GEMM that reads it, and the pairs come in the table's order."""
    made = []

    def maker(key):
        def make():
            made.append(key)
            return object()

        return make

    keys = [(op, form) for op in Operand for form in Form]
    ops = BackwardOperands(Backward.HIGH_PRECISION, {key: maker(key) for key in keys})
    assert made == []  # nothing before a GEMM asks
    dy, w = ops.of(GemmKind.DGRAD)
    assert made == [(Operand.BWD_GRAD, Form.HP), (Operand.FWD_WEIGHT, Form.HP)]
    dy_again, x = ops.of(GemmKind.WGRAD)
    assert dy_again is dy and x is not w
    assert made[2:] == [(Operand.FWD_INPUT, Form.HP)]
    assert ops.of(GemmKind.DGRAD) == (dy, w) and len(made) == 3
