"""Block-FP8 GEMM through torch._scaled_mm on the H200 against the emulated fp32 GEMM of the
same QTensors (GPU tier). The bound: bf16 output rounding (2^-8 relative) plus fp32
accumulation-order differences."""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import dequantize, quantize
from mxrl.kernels.fp8_gemm import fp8_block_matmul

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("m", "n", "k"), [(128, 256, 512), (300, 384, 1024), (1024, 2048, 640)])
def test_scaled_mm_blockwise_matches_emulated_gemm(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    xq = quantize(x, "fp8_block", block=(1, 128))
    wq = quantize(w, "fp8_block", block=(128, 128))
    y = fp8_block_matmul(xq, wq, out_dtype=torch.float32)
    ref = dequantize(xq) @ dequantize(wq).t()
    err = (y - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, float(err)  # fp32 output: only the accumulation order differs
    y16 = fp8_block_matmul(xq, wq)
    assert y16.dtype == torch.bfloat16
    assert ((y16.float() - ref).abs() <= 2**-8 * ref.abs() + 1e-3 * ref.abs().max()).all()


def test_scale_layout_is_checked():
    x = torch.randn(128, 256, device="cuda")
    with pytest.raises(ValueError, match="1x128"):
        fp8_block_matmul(quantize(x, "fp8_block"), quantize(x, "fp8_block"))
