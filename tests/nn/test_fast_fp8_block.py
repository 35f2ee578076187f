"""Block-FP8 routed experts on the tensor-core training path: the forward through the grouped
block-FP8 kernel (mxrl.kernels.fp8_gemm.grouped_fp8_block_matmul, here under Triton's
interpreter), dgrad and wgrad as bf16 grouped GEMMs (high-precision and dequantized backward)
or on the block-FP8 codes (quantized backward: the forward kernel reading w transposed, the
token-grouped wgrad kernel), each against the reference loop within the bound of docs/nn.md.
The H200 runs the same check compiled (tests/nn/test_fast_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from mxrl.nn.paths.grouped import grouped_supported
from mxrl.recipe import Backward
from tests.kernels.test_decode_gemm import interpreter
from tests.nn.test_fast import check_grouped_projection
from tests.nn.test_qmatmul import _expert_specs


@interpreter
@pytest.mark.parametrize("mode", ["high_precision", "dequantized", "quantized"])
@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_grouped_block_fp8_projection_within_the_bound(mode, which):
    check_grouped_projection("fp8_block", mode, which, size=(4, 128, 128, 45))


@interpreter
@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_grouped_block_fp8_quantized_backward_with_several_blocks_per_dim(which):
    """H 256, I 128: two 128-blocks along a weight dim, so a swap of the transposed read's
    scale strides cannot pass unnoticed."""
    check_grouped_projection("fp8_block", "quantized", which, size=(4, 256, 128, 45))


def test_block_fp8_experts_take_the_grouped_path_only_where_the_kernel_runs():
    gu, down = _expert_specs("fp8_block", e=4, h=128, i=128)
    specs = {"gate_up": gu, "down": down}
    cuda = torch.device("cuda")
    for mode in Backward:
        assert grouped_supported(specs, (128, 128), cuda, mode)
    assert not grouped_supported(specs, (128, 128), None, Backward.HIGH_PRECISION)
    # output features not in whole blocks: the quantized dgrad's transposed read cannot take
    # them; the loop (a partial last block of dy, zero-padded) does
    _, down192 = _expert_specs("fp8_block", e=4, h=192, i=128)
    odd = {"gate_up": None, "down": down192}
    assert grouped_supported(odd, (192, 128), cuda, Backward.HIGH_PRECISION)
    assert not grouped_supported(odd, (192, 128), cuda, Backward.QUANTIZED)
