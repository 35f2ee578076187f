"""`mxrl.kernels.quantize_mxfp8_padded` (MXFP8's quantized backward's two copies of a [R, K]
activation from one read: its row-wise bf16 values, and the column-wise copy of its padded
layout) byte for byte against the reference backend's composition: `qdq_mxfp8(x)`, and the
padded [P, K] rows built by index (zeros between experts) quantized along dim 0, as codes and
scales or as bf16 values. Both tiers: the interpreter (marker `triton`) and the GPU (`gpu`).

Inputs: the expert layouts the grouped GEMMs make (experts with 0, 1, 31, 32, 33 and 70 rows,
so blocks of 32 that hold one real row, or whole ones), fp32 and bf16 x, NaN / ±Inf / values
past E4M3's range, and a P that is not a multiple of the kernel's 32 x 256 tile along K.
"""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import QTensor
from tests import cases
from tests.kernels.test_dequantize import TIERS, assert_same_bf16
from tests.numerics import assert_bytes_equal

pytest.importorskip("triton")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.*")

COUNTS = [33, 0, 1, 70, 32, 31]  # rows per expert


def padded_gather(counts: list[int], device: str) -> torch.Tensor:
    """int32 [P]: each expert's rows (in order) from a 32-aligned start, -1 between; P a
    multiple of 32 (`PaddedLayout`'s shape, built here by hand)."""
    gather, start = [], 0
    for c in counts:
        gather += list(range(start, start + c)) + [-1] * (-c % 32)
        start += c
    return torch.tensor(gather, dtype=torch.int32, device=device)


def _x(dtype: torch.dtype, k: int, device: str) -> torch.Tensor:
    x = cases.randn((sum(COUNTS), k), torch.float32, seed=4) * 3
    x[5, 7], x[40, 0], x[41, 33] = float("nan"), float("inf"), -float("inf")
    x[100, 64:96] *= 1e6  # past E4M3's range before scaling: the block's scale takes it
    return x.to(dtype).to(device)


@pytest.mark.parametrize("device", TIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("col_qdq", [False, True])
def test_padded_copies_are_the_reference_bytes(device, dtype, col_qdq):
    from mxrl.kernels import ops, quantize_mxfp8_padded

    x = _x(dtype, 288, device)  # K = 288: a 256-wide tile and a partial one
    gather = padded_gather(COUNTS, device).long()  # any integer gather (the op takes int32)
    ran = []
    original = ops.EAGER["quantize_mxfp8_padded"]
    ops.EAGER["quantize_mxfp8_padded"] = lambda *a: ran.append(a[2]) or original(*a)
    try:
        got_row, got_col = quantize_mxfp8_padded(x, gather, col_qdq=col_qdq, backend="triton")
        assert ran == [col_qdq], "the triton backend did not run the kernel"
        want_row, want_col = quantize_mxfp8_padded(x, gather, col_qdq=col_qdq, backend="reference")
    finally:
        ops.EAGER["quantize_mxfp8_padded"] = original
    assert len(ran) == 1, "the reference backend ran the kernel"
    assert got_row.dtype == torch.bfloat16 and got_row.shape == x.shape
    assert_same_bf16(got_row, want_row, "row-wise bf16 values")
    if col_qdq:
        assert got_col.shape == (gather.shape[0], x.shape[1])
        assert_same_bf16(got_col, want_col, "padded column-wise bf16 values")
        return
    assert isinstance(got_col, QTensor) and got_col.axis == want_col.axis == 0
    assert got_col.shape == want_col.shape == (gather.shape[0], x.shape[1])
    assert_bytes_equal(got_col.qdata, want_col.qdata, "padded column-wise codes")
    assert_bytes_equal(got_col.scale, want_col.scale, "padded column-wise scales")


@pytest.mark.parametrize("device", TIERS)
def test_the_padding_is_zeros_and_the_rows_are_xs(device):
    """Against a padded tensor built by scatter (as the grouped backward built it before):
    the zero rows quantize to code 0, every real row lands at its padded position."""
    from mxrl.kernels import qdq_mxfp8, quantize_mxfp8_padded

    x = _x(torch.float32, 64, device)
    gather = padded_gather(COUNTS, device)
    valid = gather >= 0
    padded = x.new_zeros((gather.shape[0], x.shape[1]))
    padded[valid] = x[gather[valid].long()]
    _, col = quantize_mxfp8_padded(x, gather, col_qdq=True, backend="triton")
    want = qdq_mxfp8(padded, rowwise=False, colwise=True, backend="triton")[1]
    assert_same_bf16(col, want, "against the scattered tensor")
    assert not col[~valid].any(), "padding rows are zeros"


@pytest.mark.parametrize("device", TIERS)
def test_a_gather_that_repeats_rows_gives_the_column_copy_alone(device):
    """The grouped gate/up on x's tokens: each token read in k padded rows (rowwise=False, the
    row-wise copy made apart), the column-wise codes those of the padded tensor built by index."""
    from mxrl.kernels import quantize_mxfp8_padded

    x = _x(torch.float32, 64, device)[:60]  # 60 tokens, each gathered 3 times below
    g = torch.Generator().manual_seed(2)
    tokens = torch.randperm(60, generator=g).repeat(3).tolist()
    gather = torch.tensor(
        tokens[:100] + [-1] * 28 + tokens[100:] + [-1] * 16, dtype=torch.int32, device=device
    )  # two experts, padded to 128 and 96 rows
    got_row, got_col = quantize_mxfp8_padded(x, gather, rowwise=False, backend="triton")
    want_row, want_col = quantize_mxfp8_padded(x, gather, rowwise=False, backend="reference")
    assert got_row is None and want_row is None
    assert_bytes_equal(got_col.qdata, want_col.qdata, "codes")
    assert_bytes_equal(got_col.scale, want_col.scale, "scales")


@pytest.mark.parametrize("device", TIERS)
def test_shapes_the_blocks_do_not_fit_get_the_references_refusal(device):
    """A padded layout whose rows are not whole 32-row blocks, or x's K not whole 1x32 blocks:
    the reference's own message on either backend (the kernel is not asked)."""
    from mxrl.kernels import quantize_mxfp8_padded

    x = _x(torch.float32, 64, device)
    short = padded_gather(COUNTS, device)[:-1]  # P one short of a whole block
    for backend in ("triton", "reference"):
        with pytest.raises(ValueError, match="multiple of 32"):
            quantize_mxfp8_padded(x, short, backend=backend)
        with pytest.raises(ValueError, match="multiple of 32"):
            quantize_mxfp8_padded(x[:, :48], padded_gather(COUNTS, device), backend=backend)
