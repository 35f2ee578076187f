"""`mxrl.kernels.dequantize` (bf16 straight from the packed bytes) byte for byte against
`mxrl.formats.dequantize(q).to(torch.bfloat16)` computed on the same device (NaN where the
reference has NaN; its bits are the bf16 conversion's, see `assert_same_bf16`).

Two tiers run the same checks: the interpreter (marker `triton`, CPU tensors, the kernel's
integer bf16 rounding) and the GPU (marker `gpu`, the compiled kernel's `cvt.rn.bf16.f32`).
Inputs: every element byte against every scale code (NaN codes, subnormal products, the largest
scales), random fp8_block scales down to the bf16 subnormal range, and QTensors from the
quantizers in the layouts training uses (row-wise and column-wise MXFP8, per-token and
per-expert NVFP4 with and without the global scale, 1x128 and 128x128 block FP8 on [E, N, K]).
"""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import QTensor, quantize
from mxrl.formats import dequantize as reference_dequantize
from mxrl.formats.constants import Format
from tests import cases
from tests.kernels import conftest
from tests.numerics import assert_bytes_equal

pytest.importorskip("triton")

INTERPRETER = pytest.mark.skipif(
    not conftest.INTERPRETER_READY, reason="the interpreter tier runs without CUDA"
)
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TIERS = [
    pytest.param("cpu", marks=[pytest.mark.triton, INTERPRETER], id="interpreter"),
    pytest.param("cuda", marks=[pytest.mark.gpu, GPU], id="gpu"),
]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.*")


def _check(q: QTensor, what: str, global_scale: bool = True) -> None:
    from mxrl.kernels import dequantize

    got = dequantize(q, global_scale=global_scale, backend="triton")
    want = reference_dequantize(q, global_scale=global_scale).to(torch.bfloat16)
    assert_same_bf16(got, want, what)


def assert_same_bf16(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """NaN exactly where the reference has NaN, every other byte equal. A NaN's bf16 bits are
    the conversion's, not the contract's: torch's CPU conversion writes 0x7FC0 in its scalar
    code and 0xFFFF in its AVX2 / AVX-512 code, CUDA's 0x7FFF."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN positions differ"
    assert nan.sum() < want.numel() // 2, f"{what}: mostly NaN, the check would see little"
    keep = ~nan
    assert_bytes_equal(got[keep], want[keep], what)


def _every_code_and_scale(rows: int, cols: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [rows, cols] where each row holds every byte value (shifted per row), and a row
    index for the scale codes: row r uses scale code r % 256."""
    base = torch.arange(cols, dtype=torch.int64) % 256
    codes = (base[None, :] + 37 * torch.arange(rows)[:, None]) % 256
    return codes.to(torch.uint8).to(device), torch.arange(rows) % 256


@pytest.mark.parametrize("device", TIERS)
def test_mxfp8_every_byte_and_scale(device):
    codes, s_codes = _every_code_and_scale(256, 256, device)
    scale = s_codes.to(torch.uint8)[:, None].expand(256, 256 // 32).contiguous()
    q = QTensor(codes, scale.view(torch.float8_e8m0fnu).to(device), Format.MXFP8, codes.shape)
    _check(q, "mxfp8 row-wise, every code x every E8M0 scale")
    col_scale = torch.arange(256 * 8, dtype=torch.int64).reshape(8, 256) % 256
    col_scale = col_scale.to(torch.uint8).view(torch.float8_e8m0fnu).to(device)
    q = QTensor(codes, col_scale, Format.MXFP8, codes.shape, axis=0)
    _check(q, "mxfp8 column-wise, every code x every E8M0 scale")


@pytest.mark.parametrize("device", TIERS)
def test_nvfp4_every_byte_and_scale(device):
    packed, s_codes = _every_code_and_scale(256, 128, device)
    scale = s_codes.to(torch.uint8)[:, None].expand(256, 256 // 16).contiguous()
    scale = scale.view(torch.float8_e4m3fn).to(device)
    g = torch.Generator().manual_seed(3)
    # per-row global scales from tiny to huge: the fp32 product S_dec * value rounds, and lands
    # in bf16's subnormal range for the small ones
    exps = torch.randint(-60, 60, (256, 1), generator=g).float()
    gs = (torch.rand((256, 1), generator=g) + 0.5) * torch.exp2(exps)
    q = QTensor(packed, scale, Format.NVFP4, (256, 256), global_scale=gs.to(device))
    _check(q, "nvfp4 per row, with the global scale")
    _check(q, "nvfp4 per row, without the global scale", global_scale=False)
    q = QTensor(packed, scale, Format.NVFP4, (256, 256), global_scale=gs[7, 0].to(device))
    _check(q, "nvfp4 per tensor, with the global scale")


@pytest.mark.parametrize("device", TIERS)
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (1, 32)], ids=str)
def test_fp8_block_every_byte_random_scales(device, block):
    codes, _ = _every_code_and_scale(256, 256, device)
    br, bk = block
    g = torch.Generator().manual_seed(br + bk)
    n = (256 // br) * (256 // bk)
    exps = torch.randint(-140, 100, (n,), generator=g).float()
    sf = ((torch.rand(n, generator=g) + 0.5) * torch.exp2(exps)).reshape(256 // br, 256 // bk)
    q = QTensor(codes, sf.to(device), Format.FP8_BLOCK, codes.shape)
    assert q.block == block
    _check(q, f"fp8_block {block}, every code x random scales")


@pytest.mark.parametrize("device", TIERS)
def test_quantizer_outputs_in_training_layouts(device):
    x = cases.randn((4, 64, 256), torch.bfloat16, seed=11, scale=4.0).to(device)
    x[0, 3, 5] = float("nan")
    x[1, 7, 9] = float("inf")
    rows = x.reshape(-1, 256)
    _check(quantize(rows, "mxfp8"), "mxfp8 row-wise activations")
    _check(quantize(rows, "mxfp8", axis=0), "mxfp8 column-wise activations")
    _check(quantize(x, "mxfp8", axis=1), "mxfp8 column-wise [E, N, K] weights")
    w = torch.nan_to_num(x, nan=0.0, posinf=0.0)
    token = quantize(w.reshape(-1, 256), "nvfp4", per_token=True)
    _check(token, "nvfp4 per token")
    _check(token, "nvfp4 per token, no global scale", global_scale=False)
    amax = w.abs().amax(dim=(1, 2), keepdim=True).float()
    expert = quantize(w, "nvfp4", global_amax=amax)
    _check(expert, "nvfp4 per expert [E, 1, 1]")
    _check(quantize(w.reshape(-1, 256), "fp8_block", block=(1, 128)), "fp8_block 1x128")
    _check(quantize(w, "fp8_block", block=(32, 32)), "fp8_block 32x32 on [E, N, K]")


@pytest.mark.parametrize("device", TIERS)
def test_layouts_the_kernel_does_not_take_run_the_reference(device):
    """fp8_block blocks that overhang the tensor's rows, mxfp8 blocks along a leading dim: the
    same bytes, through the reference."""
    x = cases.randn((100, 256), torch.float32, seed=5).to(device)
    _check(quantize(x, "fp8_block", block=(128, 128)), "fp8_block overhanging blocks")
    y = cases.randn((64, 4, 32), torch.float32, seed=6).to(device)
    _check(quantize(y, "mxfp8", axis=0), "mxfp8 blocks along dim 0 of a 3-D tensor")


@pytest.mark.parametrize("device", TIERS)
def test_widen_bf16_is_the_conversion_bit_for_bit(device):
    from mxrl.kernels import to_float32

    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.cat([every, every[:4100]]).reshape(-1, 7).to(device)  # a ragged last block
    got = to_float32(x, backend="triton")
    assert_bytes_equal(got, x.to(torch.float32), "every bf16 value, NaN payloads included")


@pytest.mark.parametrize("device", TIERS)
def test_scale_bf16_is_the_fp32_product_rounded_bit_for_bit(device):
    """`scale_bf16(y, s)` against `(y.float() * s).to(bfloat16)` on the same device: every bf16
    value of y against per-row scales that round up, down, to even on exact ties (1 + 2^-8
    puts 1.0 half a bf16 ulp from its neighbours), overflow to Inf, underflow into subnormals
    and zero, and NaN / Inf / -0 scales; per-element and per-column scales; a ragged last
    block."""
    from mxrl.kernels import scale_bf16

    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    y = torch.cat([every, every[:4100]]).reshape(-1, 14).to(device)  # 4974 rows
    row_scales = torch.tensor(
        [1.0, 1 + 2**-8, 1 - 2**-9, 3.0, 0.1, 2.0**100, 2.0**-120, 2.0**-140, 0.0, -0.0,
         -1.5, float("inf"), float("nan"), 448.0 * 6.0, 1 / 2688.0, 1.0000001],
        dtype=torch.float32,
    )  # fmt: skip
    per_row = row_scales.repeat(-(-y.shape[0] // len(row_scales)))[: y.shape[0], None]
    g = torch.Generator().manual_seed(3)
    per_element = torch.exp2(torch.randn(y.shape, generator=g) * 20).to(torch.float32)
    per_column = torch.rand((1, y.shape[1]), generator=g) * 4
    from mxrl.kernels import ops

    ran = []
    original = ops.EAGER["scale_bf16"]
    ops.EAGER["scale_bf16"] = lambda *a: ran.append(a[1].shape) or original(*a)
    try:
        for what, s in (("per row", per_row), ("per element", per_element),
                        ("per column", per_column)):  # fmt: skip
            s = s.to(device)
            got = scale_bf16(y, s, backend="triton")
            assert got.dtype == torch.bfloat16 and got.shape == y.shape
            assert_same_bf16(got, (y.float() * s).to(torch.bfloat16), f"{what} scale")
        assert len(ran) == 3, "the triton backend did not run the kernel"
        scale_bf16(y, per_row.to(device), backend="reference")
        assert len(ran) == 3, "the reference backend ran the kernel"
        # what the kernel does not take runs torch's three passes: a scale that widens y,
        # a 1-D y, an fp32 y; and a scale that is not fp32 is refused
        wide = torch.rand((y.shape[0], 2, y.shape[1]), device=device)
        column = y[:, :1].contiguous()
        for y_, s_ in ((column, per_element.to(device)), (y[0], per_column.to(device)[0]),
                       (y.float(), per_row.to(device))):  # fmt: skip
            got = scale_bf16(y_, s_, backend="triton")
            assert_same_bf16(got, (y_.float() * s_).to(torch.bfloat16), "fallback")
        assert len(ran) == 3, "a shape the kernel does not take reached it"
        with pytest.raises(RuntimeError):
            scale_bf16(y, wide, backend="triton")  # does not broadcast to y
        with pytest.raises(TypeError, match="float32 scale"):
            scale_bf16(y, per_row.to(device).double(), backend="triton")
    finally:
        ops.EAGER["scale_bf16"] = original


@pytest.mark.parametrize("device", TIERS)
def test_eager_calls_run_the_body_and_tracing_sees_the_op(device, monkeypatch):
    """In eager mode the api calls each op's body (`ops.EAGER`: no custom-op dispatch); under a
    dispatch mode (FakeTensorMode, make_fx, ...) it calls the registered op, which the mode
    sees whole."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mxrl.kernels import dequantize, ops

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q = quantize(cases.randn((32, 64), torch.float32, seed=2).to(device), "mxfp8")
    bodies = []
    original = ops.EAGER["dequantize_bf16"]
    monkeypatch.setitem(ops.EAGER, "dequantize_bf16", lambda *a: bodies.append(1) or original(*a))
    eager = dequantize(q, backend="triton")
    assert bodies == [1]
    with Seen() as mode:
        traced = dequantize(q, backend="triton")
    assert bodies == [1] and any("mxrl.dequantize_bf16" in op for op in mode.ops), mode.ops
    assert_bytes_equal(traced, eager, "the op and its body")


@pytest.mark.parametrize("device", TIERS)
@pytest.mark.parametrize(("rowwise", "colwise"), [(True, False), (False, True), (True, True)])
def test_qdq_mxfp8_is_quantize_then_dequantize(device, rowwise, colwise):
    """`qdq_mxfp8`: the bf16 dequantized values of each MXFP8 copy from one kernel, equal to
    the reference's quantize -> dequantize -> bf16 (NaN and Inf inputs, a 3-D input, a ragged
    last tile)."""
    from mxrl.kernels import qdq_mxfp8

    for label, x in [
        ("2-D with NaN/Inf", cases.randn((96, 160), torch.bfloat16, seed=3, scale=6.0)),
        ("3-D fp32", cases.randn((3, 64, 96), torch.float32, seed=4, scale=1e-3)),
    ]:
        x = x.clone()
        x.view(-1)[7] = float("nan")
        x.view(-1)[100] = float("-inf")
        x = x.to(device)
        row, col = qdq_mxfp8(x, rowwise=rowwise, colwise=colwise, backend="triton")
        want_row, want_col = qdq_mxfp8(x, rowwise=rowwise, colwise=colwise, backend="reference")
        assert (row is None) == (not rowwise) and (col is None) == (not colwise)
        if rowwise:
            assert_same_bf16(row, want_row, f"{label} row-wise")
        if colwise:
            assert_same_bf16(col, want_col, f"{label} column-wise")


def test_a_cpu_tensor_asked_for_triton_is_checked_against_the_cpu(monkeypatch):
    """On a machine with a GPU, a CPU tensor asked for the triton backend (the interpreter off)
    is refused for its own device, the CPU, by `scale_bf16` and `quantize_mxfp8_padded`: the
    check takes the tensor's device, not the machine's default one (CUDA)."""
    from mxrl.kernels import backend as backend_mod
    from mxrl.kernels import quantize_mxfp8_padded, scale_bf16

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    assert backend_mod.select_backend().value == "triton", "the machine looks like a GPU's"
    y = cases.randn((32, 64), torch.bfloat16, seed=5)
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        scale_bf16(y, torch.ones((32, 1)), backend="triton")
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        quantize_mxfp8_padded(y, torch.arange(32, dtype=torch.int32), backend="triton")
