"""The routed experts' block-FP8 weight gradient (mxrl.kernels.fp8_gemm.grouped_fp8_block_wgrad,
a GEMM grouped along its reduction) under Triton's interpreter: within its bound of the
contract's emulated GEMM, with experts without tokens, ragged token counts zero-padded to whole
128-token blocks and N / K not multiples of the tile; an expert's gradient independent of the
other experts' tokens; bad layouts refused."""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import dequantize, quantize
from mxrl.kernels.fp8_gemm import grouped_fp8_block_wgrad, grouped_fp8_block_wgrad_reference
from tests.kernels.test_decode_gemm import interpreter
from tests.numerics import assert_bytes_equal


def _layout(counts, n, k, seed=0):
    """dy [R, N] and x [R, K] of tokens sorted by expert, each expert's tokens zero-padded to a
    multiple of 128; returns a = dy^T and b = x^T quantized 1x128 along the tokens, offsets."""
    g = torch.Generator().manual_seed(seed)
    padded = [-(-c // 128) * 128 for c in counts]
    r = sum(padded)
    dy, x = torch.zeros(r, n), torch.zeros(r, k)
    start = 0
    for c, p in zip(counts, padded, strict=True):
        dy[start : start + c] = torch.randn(c, n, generator=g) * torch.rand(c, 1, generator=g)
        x[start : start + c] = torch.randn(c, k, generator=g) * 3
        start += p
    offsets = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    aq = quantize(dy.T.contiguous(), "fp8_block", block=(1, 128))
    bq = quantize(x.T.contiguous(), "fp8_block", block=(1, 128))
    return aq, bq, offsets


def _bound(aq, bq, offsets):
    """Summation order and where the scales multiply: (R_e * 2^-22 + 2^-20) * sum |a||b|."""
    mag = grouped_fp8_block_wgrad_reference(
        quantize(dequantize(aq).abs(), "fp8_block", block=(1, 128)),
        quantize(dequantize(bq).abs(), "fp8_block", block=(1, 128)),
        offsets,
    )
    rows = (offsets[1:] - offsets[:-1]).float()[:, None, None]
    return (rows * 2**-22 + 2**-20) * mag * 2


@interpreter
@pytest.mark.parametrize(("counts", "n", "k"), [([130, 0, 5, 1], 96, 80), ([256, 40], 64, 128)])
def test_grouped_wgrad_is_within_its_bound(counts, n, k):
    aq, bq, offsets = _layout(counts, n, k)
    got = grouped_fp8_block_wgrad(aq, bq, offsets)
    want = grouped_fp8_block_wgrad_reference(aq, bq, offsets)
    assert got.shape == (len(counts), n, k) and got.dtype == torch.float32
    err = (got - want).abs()
    assert (err <= _bound(aq, bq, offsets)).all(), (err - _bound(aq, bq, offsets)).max()
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(got[e], torch.zeros(n, k)), f"expert {e} has no tokens"
        else:
            assert want[e].abs().max() > 0


@interpreter
def test_an_experts_gradient_does_not_depend_on_the_other_experts_tokens():
    aq, bq, offsets = _layout([130, 7, 60], 64, 64, seed=1)
    full = grouped_fp8_block_wgrad(aq, bq, offsets)
    # expert 1 alone: its 128 token columns, as the only expert
    cols = slice(int(offsets[1]), int(offsets[2]))
    from mxrl.formats import QTensor

    a1 = QTensor(aq.qdata[:, cols], aq.scale[:, cols.start // 128 : cols.stop // 128], aq.fmt,
                 torch.Size((64, 128)))  # fmt: skip
    b1 = QTensor(bq.qdata[:, cols], bq.scale[:, cols.start // 128 : cols.stop // 128], bq.fmt,
                 torch.Size((64, 128)))  # fmt: skip
    alone = grouped_fp8_block_wgrad(a1, b1, torch.tensor([0, 128], dtype=torch.int32))
    assert_bytes_equal(alone[0], full[1], "expert 1 alone")


def test_a_layout_whose_experts_straddle_a_block_is_refused():
    aq, bq, _ = _layout([128, 128], 64, 64)
    with pytest.raises(ValueError, match="multiple of 128"):
        grouped_fp8_block_wgrad(aq, bq, torch.tensor([0, 100, 256], dtype=torch.int32))
    with pytest.raises(ValueError, match="1x128 blocks"):
        grouped_fp8_block_wgrad(quantize(torch.randn(64, 256), "fp8_block"), bq,
                                torch.tensor([0, 256], dtype=torch.int32))  # fmt: skip


@interpreter
def test_the_split_into_runs_of_experts_changes_no_byte():
    """One program streams a run of experts' token blocks, storing each expert's tile at its
    last block: all experts in one run, or each in its own, give the same bytes (experts
    without tokens included)."""
    aq, bq, offsets = _layout([130, 0, 5, 260, 0, 1], 64, 64, seed=2)
    one = grouped_fp8_block_wgrad(aq, bq, offsets, runs=1)
    want = grouped_fp8_block_wgrad_reference(aq, bq, offsets)
    assert ((one - want).abs() <= _bound(aq, bq, offsets)).all()
    for runs in (2, 4, 6):
        assert_bytes_equal(grouped_fp8_block_wgrad(aq, bq, offsets, runs=runs), one, f"{runs}")
    assert torch.equal(one[1], torch.zeros(64, 64)) and torch.equal(one[4], torch.zeros(64, 64))
