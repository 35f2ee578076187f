"""The SQNR's two sums in one pass (`mxrl.kernels.error_sums` on the triton backend, under the
interpreter): [sum w^2, sum (w - dequantize(q))^2] against the reference's fp32 dequantization
and float64 sums, for every format and the layouts the export quantizes (2-D weights, 3-D
experts, NVFP4 global scales per tensor, per expert and per row, a bf16 master), to fp32
rounding inside a tile."""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import dequantize
from mxrl.kernels import Backend, error_sums, quantize
from tests.kernels.test_decode_gemm import interpreter


def _expected(q, master):
    """Written from the definition, in float64 throughout."""
    w = master.double()
    err = w - dequantize(q).double()
    return torch.tensor([w.square().sum().item(), err.square().sum().item()], dtype=torch.float64)


CASES = [
    ("mxfp8", (96, 256), {}),
    ("mxfp8", (3, 64, 128), {}),
    ("nvfp4", (80, 160), {}),
    ("nvfp4", (3, 32, 64), {"global_amax": "expert"}),
    ("nvfp4", (48, 96), {"global_amax": "row"}),
    ("fp8_block", (256, 384), {"block": (128, 128)}),
    ("fp8_block", (40, 256), {"block": (1, 128)}),
]


def _global_amax(w, how):
    if how == "expert":
        return w.abs().amax(dim=(1, 2), keepdim=True)
    return w.abs().amax(dim=-1, keepdim=True)


@interpreter
@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "shape", "options"), CASES)
def test_one_pass_sums_are_the_definitions(fmt, shape, options, master_dtype):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    w = (torch.randn(shape, generator=g) * torch.rand((*shape[:-1], 1), generator=g) * 4).to(
        master_dtype
    )
    opts = dict(options)
    if "global_amax" in opts:
        opts["global_amax"] = _global_amax(w.float(), opts["global_amax"])
    q = quantize(w, fmt, backend=Backend.REFERENCE, **opts)
    got = error_sums(q, w, backend=Backend.TRITON)
    want = _expected(q, w)
    assert got.dtype == torch.float64 and got.shape == (2,)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0.0)
    assert got[1] > 0  # the quantization lost something: the noise term is not empty
    reference = error_sums(q, w, backend=Backend.REFERENCE)
    torch.testing.assert_close(reference, want, rtol=1e-7, atol=0.0)


@interpreter
def test_an_exact_quantization_has_no_noise():
    """Values every format holds exactly (small integers, one power-of-two scale per block):
    the noise term is exactly 0 on both paths, so the SQNR is +inf as the reference says."""
    w = torch.tensor([[1.0, -2.0, 4.0, 0.5] * 8] * 4)
    q = quantize(w, "mxfp8", backend=Backend.REFERENCE)
    for backend in (Backend.TRITON, Backend.REFERENCE):
        sums = error_sums(q, w, backend=backend)
        assert sums[1].item() == 0.0
        assert sums[0].item() == float((w.double() ** 2).sum())


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "shape", "options"), CASES)
def test_one_pass_sums_on_cuda(fmt, shape, options):
    """Compiled: the export's default on a GPU (`weights.event`), against the reference."""
    g = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(shape, generator=g, device="cuda") * 3
    opts = dict(options)
    if "global_amax" in opts:
        opts["global_amax"] = _global_amax(w, opts["global_amax"])
    q = quantize(w, fmt, backend=Backend.REFERENCE, **opts)
    got = error_sums(q, w)  # the device's default: triton
    torch.testing.assert_close(got.cpu(), _expected(q, w).cpu(), rtol=2e-6, atol=0.0)
