"""The reference quantizer is a pure function of its input: the same bytes on CUDA as on the CPU
(DESIGN.md §5). GPU tier: `pytest -m gpu` on a CUDA machine."""

from __future__ import annotations

import pytest

from mxrl.formats import dequantize, quantize, swizzle_scales
from tests import cases
from tests.numerics import assert_bytes_equal, assert_qtensor_bytes_equal

pytestmark = pytest.mark.gpu

VARIANTS = [
    ("mxfp8", {}, cases.SHAPES_MXFP8),
    ("mxfp8", {"axis": 0}, [(128, 96), (992, 512)]),
    ("mxfp8", {"scale_mode": "floor"}, cases.SHAPES_MXFP8),
    ("nvfp4", {}, cases.SHAPES_NVFP4),
    ("nvfp4", {"per_token": True}, cases.SHAPES_NVFP4),
    ("nvfp4", {"scale_mode": "4over6"}, cases.SHAPES_NVFP4),
    ("nvfp4", {"per_token": True, "scale_mode": "4over6"}, cases.SHAPES_NVFP4),
    ("fp8_block", {}, cases.SHAPES_FP8_BLOCK),
    ("fp8_block", {"block": (1, 128)}, cases.SHAPES_FP8_BLOCK),
    ("fp8_block", {"scale_mode": "ue8m0"}, cases.SHAPES_FP8_BLOCK),
]


def _inputs(fmt, shapes):
    yield from cases.suite(shapes)
    for d in cases.DTYPES:
        yield f"boundary-{d}", cases.boundary_pairs((32, 128), d)
        if fmt == "mxfp8":
            yield f"pow2-{d}", cases.mxfp8_pow2_edges(d)
        if fmt == "nvfp4":
            yield f"underflow-{d}", cases.nvfp4_underflow(d)
        yield f"large-{d}", cases.randn((4096, 1024), d, seed=77, scale=8.0)


@pytest.mark.parametrize(
    ("fmt", "kwargs", "shapes"), VARIANTS, ids=[f"{v[0]}-{v[1]}" for v in VARIANTS]
)
def test_cuda_bytes_equal_cpu_bytes(fmt, kwargs, shapes):
    for label, x in _inputs(fmt, shapes):
        if fmt == "mxfp8" and kwargs.get("axis") == 0 and x.shape[0] % 32:
            continue
        cpu = quantize(x, fmt, **kwargs)
        gpu = quantize(x.cuda(), fmt, **kwargs)
        assert gpu.device.type == "cuda"
        assert_qtensor_bytes_equal(gpu.to("cpu"), cpu, f"{fmt} {kwargs} {label}")
        assert_bytes_equal(dequantize(gpu).cpu(), dequantize(cpu), f"{label} dequantized")
        if cpu.scale.element_size() == 1 and cpu.scale.dim() == 2 and kwargs.get("axis") is None:
            assert_bytes_equal(swizzle_scales(gpu.scale).cpu(), swizzle_scales(cpu.scale), label)
