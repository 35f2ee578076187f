"""Block-FP8 GEMM through torch._scaled_mm on the H200 against the emulated fp32 GEMM of the
same QTensors (GPU tier). The bound: 2e-3 of the output's max for Hopper's reduced-precision
FP8 accumulation (measured ~2e-4 at K=2048), plus 2^-8 relative for a bf16 output."""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import dequantize, quantize
from mxrl.kernels.fp8_gemm import fp8_block_matmul

pytestmark = pytest.mark.gpu


# Each of M % 4, (K / 128) % 4 and (N / 128) % 4 off in turn: the padding cuBLASLt needs.
SHAPES = [(128, 512, 512), (128, 256, 512), (301, 512, 512), (128, 512, 640), (512, 2048, 2048)]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_scaled_mm_blockwise_matches_emulated_gemm(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    xq = quantize(x, "fp8_block", block=(1, 128))
    wq = quantize(w, "fp8_block", block=(128, 128))
    y = fp8_block_matmul(xq, wq, out_dtype=torch.float32)
    ref = dequantize(xq) @ dequantize(wq).t()
    err = (y - ref).abs().max() / ref.abs().max()
    assert err < 2e-3, float(err)  # fp32 output: Hopper FP8 accumulation precision
    y16 = fp8_block_matmul(xq, wq)
    assert y16.dtype == torch.bfloat16
    assert ((y16.float() - ref).abs() <= 2**-8 * ref.abs() + 2e-3 * ref.abs().max()).all()


def test_scale_layout_is_checked():
    x = torch.randn(128, 256, device="cuda")
    with pytest.raises(ValueError, match="1x128"):
        fp8_block_matmul(quantize(x, "fp8_block"), quantize(x, "fp8_block"))
