"""The grouped block-FP8 GEMM (mxrl.kernels.fp8_gemm.grouped_fp8_block_matmul) under Triton's
interpreter: within its bound of the contract's emulated GEMM, empty experts and ragged shapes,
and a row's bytes independent of the other rows."""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import QTensor, dequantize, quantize
from mxrl.kernels.fp8_gemm import grouped_fp8_block_matmul, grouped_fp8_block_reference
from tests.kernels.test_decode_gemm import interpreter
from tests.numerics import assert_bytes_equal


def _case(counts, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    r, e = sum(counts), len(counts)
    x = torch.randn(r, k, generator=g) * torch.rand(r, 1, generator=g).mul(4)
    w = torch.randn(e, n, k, generator=g) * 0.05
    xq = quantize(x, "fp8_block", block=(1, 128))
    wq = quantize(w, "fp8_block")
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return xq, wq, offsets


def _bound(xq, wq, offsets, out_dtype):
    """Summation order and where the scales multiply (fp32: K * 2^-22 of sum |x||w|), plus
    the output's rounding."""
    ax, aw = dequantize(xq).abs(), dequantize(wq).abs()
    mag = grouped_fp8_block_reference(
        quantize(ax, "fp8_block", block=(1, 128)), quantize(aw, "fp8_block"), offsets
    )
    k = xq.shape[1]
    out_eps = torch.finfo(out_dtype).eps if out_dtype != torch.float32 else 0.0
    return (k * 2**-22 + 2**-20) * mag * 2, out_eps


@interpreter
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("counts", "n", "k"), [([5, 0, 9, 1, 3], 200, 256), ([17, 4], 64, 384)])
def test_grouped_fp8_block_is_within_its_bound(out_dtype, counts, n, k):
    xq, wq, offsets = _case(counts, n, k)
    got = grouped_fp8_block_matmul(xq, wq, offsets, out_dtype=out_dtype)
    want = grouped_fp8_block_reference(xq, wq, offsets)
    tol, out_eps = _bound(xq, wq, offsets, out_dtype)
    err = (got.float() - want).abs()
    assert (err <= tol + out_eps * want.abs()).all(), (err - tol).max()


@interpreter
def test_grouped_fp8_block_rows_do_not_depend_on_the_batch():
    xq, wq, offsets = _case([6, 3, 7], 128, 256, seed=1)
    full = grouped_fp8_block_matmul(xq, wq, offsets, out_dtype=torch.bfloat16)
    # expert 2's rows 9..15 alone: a batch holding only them
    rows = slice(9, 16)
    x_alone = QTensor(xq.qdata[rows], xq.scale[rows], xq.fmt, torch.Size((7, 256)))
    alone = grouped_fp8_block_matmul(
        x_alone, wq, torch.tensor([0, 0, 0, 7], dtype=torch.int32), out_dtype=torch.bfloat16
    )
    assert_bytes_equal(alone, full[rows], "expert 2 alone")
