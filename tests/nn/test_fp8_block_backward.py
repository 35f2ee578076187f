"""The block-FP8 quantized backward (DeepSeek-V3's FP8 backward; docs/nn.md), on the CPU:

- the reference op multiplies exactly the operands docs/nn.md names, written out here from
  mxrl.formats (not from mxrl.nn), bit for bit: dgrad on dy in 1x128 blocks along N and the
  forward's own 128x128 weight blocks, wgrad on dy and x quantized in 128-token blocks (zero
  padded), each copy from the high-precision tensor;
- the tensor-core op (the emulated GEMMs off CUDA) gives the reference's gradients within the
  fp32 summation-order bound and holds no second weight copy for routed experts;
- output features that are not whole 1x128 blocks pad dy with zeros (a partial last block).
The grouped experts' kernels: tests/nn/test_fast_fp8_block.py; on the H200: test_fast_gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mxrl.formats import dequantize, quantize
from mxrl.kernels import Gemm
from mxrl.nn import QExperts, QLinear, set_gemm
from tests.nn.test_fast import EXACT, _run, assert_within
from tests.nn.test_qmatmul import _expert_specs, _experts, spec
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability

N, K = 256, 128


def _linear(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, n, bias=False)
    with torch.no_grad():  # columns over 5 decades: blocks along the wrong axis would show
        lin.weight.copy_(torch.randn(n, K, generator=g) * torch.logspace(-3, 1, K))
    return QLinear.from_linear(lin, spec("fp8_block", shape=(n, K)), "quantized")


def _inputs(rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=g) * torch.logspace(-2, 1, K)
    dy = torch.randn(rows, N, generator=g) * torch.logspace(1, -3, N)
    return x, dy


def _col(t):
    """deq of t^T [C, rows padded to 128] in 1x128 blocks (t's 128x1 blocks), cut to rows."""
    rows = t.shape[0]
    padded = torch.cat([t.float(), torch.zeros(-rows % 128, t.shape[1])])
    return dequantize(quantize(padded.t().contiguous(), "fp8_block", block=(1, 128)))[:, :rows]


@pytest.mark.parametrize("rows", [50, 128, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_backward_is_the_block_fp8_formulas(rows, dtype):
    q = _linear()
    x, dy = (t.to(dtype) for t in _inputs(rows))
    xg = x.clone().requires_grad_(True)
    q(xg).backward(dy)
    w = q.weight.detach()
    dy_row = dequantize(quantize(dy.float(), "fp8_block", block=(1, 128)))
    w_blocks = dequantize(quantize(w, "fp8_block", block=(128, 128)))  # the forward's copy
    assert_bytes_equal(xg.grad, (dy_row @ w_blocks).to(dtype), "dx")
    assert_bytes_equal(q.weight.grad, _col(dy) @ _col(x).t(), "dw")
    # the 1x128 row copy of dy is not the wgrad's operand: blocks follow each GEMM's reduction
    assert not torch.equal(q.weight.grad, dy_row.t() @ _col(x).t())


def test_padding_tokens_are_zeros():
    """50 tokens, padded to 128 for the wgrad copies: the gradient of 50 tokens with 78 zero
    tokens appended, byte for byte."""
    q = _linear()
    x, dy = _inputs(50)
    q(x).backward(dy)
    dw = q.weight.grad.clone()
    q.weight.grad = None
    q(torch.cat([x, torch.zeros(78, K)])).backward(torch.cat([dy, torch.zeros(78, N)]))
    assert_bytes_equal(dw, q.weight.grad, "dw")


@pytest.mark.parametrize("rows", [50, 256])
def test_tensor_core_backward_within_the_order_bound(rows):
    q = _linear()
    x, dy = _inputs(rows)
    dy = dy.to(torch.bfloat16).float()
    y_ref, dx_ref, dw_ref = _run(q, Gemm.REFERENCE, x, dy)
    y, dx, dw = _run(q, Gemm.TENSOR_CORE, x, dy)
    assert_bytes_equal(y, y_ref, "forward (emulated off CUDA)")
    w = q.weight.detach()
    # the operands are the same bytes; only the order of the fp32 sums may differ
    assert_within(dx, dx_ref, 2 * dy.abs() @ w.abs(), N, EXACT, "dx")
    assert_within(dw, dw_ref, 2 * dy.abs().t() @ x.abs(), rows, EXACT, "dw")


def test_weight_copies_held_for_the_step():
    """Routed experts hold the forward's codes only (the grouped dgrad reads them transposed in
    place); a dense weight adds their transpose (1 byte per weight) only where the FP8 GEMM
    reads it (CUDA: tests/nn/test_fast_gpu.py), none here."""
    q = _linear()
    assert q.qweight(Gemm.TENSOR_CORE).col() is None and q.qweight(Gemm.REFERENCE).col() is None
    experts = _experts(e=4, h=128, i=128)
    specs = _expert_specs("fp8_block", e=4, h=128, i=128)
    qe = QExperts.from_experts(experts, *specs, "quantized")
    for which in ("gate_up", "down"):
        tw, wq = qe.qweight(which, Gemm.TENSOR_CORE), qe.qweight(which, Gemm.REFERENCE)
        assert tw.col() is None and wq.col() is None


@pytest.mark.parametrize("gemm", [Gemm.REFERENCE, Gemm.TENSOR_CORE])
def test_output_features_not_whole_blocks_pad_dy_with_zeros(gemm):
    """N = 192: dy's last 1x128 block is partial (zero-padded, as the weight's own last
    row-block): dx is that formula, bit for bit, on both paths."""
    n = 192
    q = _linear(n=n)
    set_gemm(q, gemm)
    x, dy = _inputs(40)
    dy = dy[:, :n].contiguous()
    xg = x.clone().requires_grad_(True)
    q(xg).backward(dy)
    padded = torch.cat([dy, torch.zeros(40, 64)], dim=1)
    dy_row = dequantize(quantize(padded, "fp8_block", block=(1, 128)))[:, :n]
    w_blocks = dequantize(quantize(q.weight.detach(), "fp8_block", block=(128, 128)))
    assert_bytes_equal(xg.grad, dy_row @ w_blocks, "dx")
