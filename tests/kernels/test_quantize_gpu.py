"""GPU tier: the compiled Triton kernels byte for byte against the reference (`pytest -m gpu`).

- the spec §6.3 suite (tests/cases.py) with edges and NaN/Inf, reference on the CPU;
- large inputs (4096 x 8192, bf16 and fp32), reference on the same GPU (device-invariant,
  tests/formats/test_device_invariance.py);
- the hardware E4M3 cast (`cvt.rn.satfinite.e4m3x2.f32`) against the exact integer encoder that
  the interpreter tests check, on every bf16 value and 2^24 random fp32 bit patterns;
- the ops under FakeTensorMode, torch.compile(fullgraph=True) and a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import codecs
from mxrl.formats import quantize as reference_quantize
from tests import cases
from tests.formats import test_finite_range as FR
from tests.kernels import variants as V
from tests.numerics import assert_bytes_equal, assert_qtensor_bytes_equal

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
tc = pytest.importorskip("mxrl.kernels.triton_codecs")


@pytest.mark.parametrize("variant", V.VARIANTS, ids=V.VARIANT_IDS)
def test_suite_bytes_equal_reference(variant):
    for label, x in V.inputs(variant):
        if variant.accepts(x):
            got = V.run_kernel(variant, x.cuda())
            V.assert_same_bytes(variant, got, V.run_reference(variant, x), label)


@pytest.mark.parametrize("dtype", cases.DTYPES, ids=str)
@pytest.mark.parametrize("variant", V.VARIANTS, ids=V.VARIANT_IDS)
def test_large_bytes_equal_reference(variant, dtype):
    x = cases.randn((4096, 8192), dtype, seed=77, scale=8.0).cuda()
    if variant.amax == "lead":
        x = x.view(8, 512, 8192)
    V.assert_same_bytes(variant, V.run_kernel(variant, x), V.run_reference(variant, x), "large")


@pytest.mark.parametrize("config", FR.POW2, ids=[c[0] for c in FR.POW2])
def test_top_of_the_range_table(config):
    """tests/formats/test_finite_range.py's table on the compiled kernels (the hardware cvt
    after the min/max that caps elements at 240 under the scale 2^120)."""
    from mxrl.kernels import quantize

    def on_gpu(x, fmt, **kwargs):
        return quantize(x.cuda(), fmt, backend="triton", **kwargs)

    for edge in FR.EDGES:
        FR.check_table(on_gpu, config, edge)


def test_large_non_finite():
    x = V.with_non_finite(cases.randn((2048, 4096), torch.bfloat16, seed=8, scale=8.0)).cuda()
    for variant in V.VARIANTS:
        if variant.accepts(x):
            got, want = V.run_kernel(variant, x), V.run_reference(variant, x)
            V.assert_same_bytes(variant, got, want, "non-finite")


def test_exact_e4m3_path_matches_too():
    """The integer E4M3 encoder (the interpreter's path) gives the same bytes on the GPU."""
    from mxrl.kernels.triton_fp8_block import launch_fp8_block
    from mxrl.kernels.triton_mxfp8 import launch_mxfp8
    from mxrl.kernels.triton_nvfp4 import launch_nvfp4

    for label, x in cases.suite([(128, 256), (992, 512)]):
        xc = x.cuda()
        row, col = reference_quantize(x, "mxfp8"), reference_quantize(x, "mxfp8", axis=0)
        q_row, s_row, q_col, s_col = launch_mxfp8(xc, True, True, hw=False)
        assert_bytes_equal(q_row, row.qdata, f"{label} mxfp8 row")
        assert_bytes_equal(s_row, row.scale.view(torch.uint8), f"{label} mxfp8 row scale")
        assert_bytes_equal(q_col, col.qdata, f"{label} mxfp8 col")
        assert_bytes_equal(s_col, col.scale.view(torch.uint8), f"{label} mxfp8 col scale")
        nv = reference_quantize(x, "nvfp4", per_token=True)
        q, s, _ = launch_nvfp4(xc, None, hw=False)
        assert_bytes_equal(q, nv.qdata, f"{label} nvfp4")
        assert_bytes_equal(s, nv.scale.view(torch.uint8), f"{label} nvfp4 scale")
        fb = reference_quantize(x, "fp8_block", block=(1, 128))
        q, _ = launch_fp8_block(xc.view(1, *x.shape), (1, 128), False, hw=False)
        assert_bytes_equal(q.view(x.shape), fb.qdata, f"{label} fp8_block")


@triton.jit
def _e4m3_both_kernel(x_ptr, hw_ptr, exact_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(hw_ptr + offs, tc.e4m3_encode(v, True), mask=offs < n)
    tl.store(exact_ptr + offs, tc.e4m3_encode(v, False), mask=offs < n)


def test_hardware_e4m3_cast_equals_exact_encoder():
    g = torch.Generator().manual_seed(1)
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 24,), generator=g, dtype=torch.int32)
    scaled = torch.randn(1 << 22, generator=g) * torch.exp2(
        torch.randint(-16, 12, (1 << 22,), generator=g).float()
    )
    x = torch.cat([every_bf16.float(), bits.view(torch.float32), scaled]).cuda()
    hw = torch.empty(x.shape, dtype=torch.uint8, device="cuda")
    exact = torch.empty_like(hw)
    block = 4096
    _e4m3_both_kernel[(triton.cdiv(x.numel(), block),)](x, hw, exact, x.numel(), BLOCK=block)
    assert_bytes_equal(hw, exact, "hw cvt vs exact")
    assert_bytes_equal(exact, codecs.e4m3_encode(x.cpu()), "exact vs reference")


def test_ops_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mxrl.kernels import ops

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros((4, 64, 96), dtype=torch.bfloat16, device="cuda"))
        q_row, s_row, q_col, s_col = ops.quantize_mxfp8(x, True, True)
        assert (q_row.shape, s_row.shape) == ((4, 64, 96), (4, 64, 3))
        assert (q_col.shape, s_col.shape) == ((4, 64, 96), (4, 2, 96))
        q, s, gs = ops.quantize_nvfp4(x, None, True)
        assert (q.shape, s.shape, gs.shape) == ((4, 64, 48), (4, 64, 6), (4, 64, 1))
        assert (q.dtype, s.dtype, gs.dtype) == (torch.uint8, torch.uint8, torch.float32)
        assert ops.quantize_nvfp4(x, None, False)[2].shape == ()
        x2 = mode.from_tensor(torch.zeros((130, 256), dtype=torch.bfloat16, device="cuda"))
        q, sf = ops.quantize_fp8_block(x2, 128, 128, False)
        assert (q.shape, sf.shape, sf.dtype) == ((130, 256), (2, 2), torch.float32)


def _all_ops(x):
    ops = torch.ops.mxrl
    return (
        *ops.quantize_mxfp8(x, True, True),
        *ops.quantize_nvfp4(x, None, True),
        *ops.quantize_nvfp4(x, None, False),
        *ops.quantize_fp8_block(x, 128, 128, True),
        *ops.quantize_fp8_block(x, 1, 128, False),
    )


def test_ops_under_torch_compile_fullgraph():
    import mxrl.kernels.ops  # noqa: F401  (registers torch.ops.mxrl.*)

    x = cases.randn((256, 512), torch.bfloat16, seed=2, scale=4.0).cuda()
    eager = _all_ops(x)
    compiled = torch.compile(_all_ops, fullgraph=True)(x)
    for i, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        assert_bytes_equal(a, b, f"output {i}")


def test_ops_in_a_cuda_graph():
    import mxrl.kernels.ops  # noqa: F401

    x = cases.randn((256, 512), torch.bfloat16, seed=3, scale=4.0).cuda()
    eager = _all_ops(x)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _all_ops(static_x)  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _all_ops(static_x)
    static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(outs, eager, strict=True)):
        assert_bytes_equal(a, b, f"output {i}")


def test_kernels_quantize_defaults_to_triton_on_cuda():
    from mxrl.kernels import Backend, quantize, select_backend

    assert select_backend(device="cuda") is Backend.TRITON
    x = cases.randn((64, 256), torch.bfloat16, seed=4).cuda()
    assert_qtensor_bytes_equal(quantize(x, "mxfp8").to("cpu"), reference_quantize(x.cpu(), "mxfp8"))
