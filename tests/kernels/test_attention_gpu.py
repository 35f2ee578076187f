"""The paged attention on an FP8 KV cache, compiled on a GPU. The hardware E4M3 conversion the
kernel decodes with there (`HW`), times the slot's scale and cast to the compute dtype, gives
byte for byte the keys and values the reference reads back, every code included. The attention
over them then equals the kernel's attention over a cache holding those dequantized values: byte
for byte in fp32 (an IEEE dot), and within one bf16 unit in the last place in bf16, where the
tensor-core dot the compiler picks for keys decoded in registers and for keys loaded from
memory sums in another order (measured on an H200: 1 to 67 of 22,016 outputs one unit apart).
GPU tier (the interpreter's integer decode: tests/kernels/test_attention.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from mxrl.engine.kv_cache import KVCache, PagedAttention
from mxrl.kernels.triton_attention import _e4m3_values
from mxrl.nn.kv_quant import dequantize_kv
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.gpu

BS, KV_HEADS, D, BLOCKS = 16, 4, 128, 12
CUDA = torch.device("cuda")


def _pair(dtype: torch.dtype, every_code: bool):
    """An FP8 cache (random keys and values, or `every_code`: each E4M3 byte but the two NaNs in
    turn, scales drawn at random) and a `dtype` cache holding what the reference reads back."""
    fp8 = KVCache(1, BLOCKS, BS, KV_HEADS, D, dtype, CUDA, fp8=True)
    g = torch.Generator(device=CUDA).manual_seed(0)
    if every_code:
        codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], device=CUDA)
        for held, scales in ((fp8.k[0], fp8.k_scale[0]), (fp8.v[0], fp8.v_scale[0])):
            n = held.numel()
            pick = torch.randint(0, codes.numel(), (n,), generator=g, device=CUDA)
            held.view(-1).copy_(codes[pick].to(torch.uint8))
            scales.copy_(torch.rand(scales.shape, generator=g, device=CUDA) / 8 + 2.0**-20)
    else:
        slots = torch.arange(BLOCKS * BS, device=CUDA)
        k = torch.randn(KV_HEADS, BLOCKS * BS, D, generator=g, device=CUDA) * 3
        v = torch.randn(KV_HEADS, BLOCKS * BS, D, generator=g, device=CUDA) / 5
        fp8.write(0, slots, k.to(dtype), v.to(dtype))
    plain = KVCache(1, BLOCKS, BS, KV_HEADS, D, dtype, CUDA)
    everything = torch.arange(BLOCKS, device=CUDA)
    plain.k[0].copy_(fp8.gather(0, False, everything))
    plain.v[0].copy_(fp8.gather(0, True, everything))
    return fp8, plain


def _attend(cache, requests, q, group):
    """The kernel's attention of tokens already in the cache (the step writes zeros to the
    scratch block 11, never read)."""
    t = q.shape[1]
    slots = torch.full((t,), 11 * BS, dtype=torch.long, device=CUDA)
    zeros = torch.zeros(KV_HEADS, t, D, dtype=q.dtype, device=CUDA)
    return PagedAttention(cache, slots, requests, group=group, kernel=True)(0, q, zeros, zeros)


@pytest.mark.parametrize("every_code", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 4])
def test_the_kernel_reads_an_fp8_cache_as_its_dequantized_values_on_cuda(dtype, group, every_code):
    fp8, plain = _pair(dtype, every_code)
    g = torch.Generator(device=CUDA).manual_seed(3)
    # a 37-token prefill, a 1-token decode at position 20, a 5-token chunk at 40..44
    requests = [(0, 37, 37, [0, 1, 2]), (37, 1, 21, [3, 4]), (38, 5, 45, [5, 6, 7])]
    q = torch.randn(KV_HEADS * group, 43, D, generator=g, device=CUDA).to(dtype)
    got = _attend(fp8, requests, q, group)
    want = _attend(plain, requests, q, group)
    assert torch.isfinite(got).all()
    if dtype == torch.float32:
        assert_bytes_equal(got, want, f"{dtype} group {group}")
        return
    # bf16: the same values through another tensor-core summation order (module docstring):
    # every output at most one unit in the last place away, and few of them
    ulps = _bf16_ulps_apart(got, want)
    assert int(ulps.max()) <= 1, f"group {group}: {int(ulps.max())} units apart"
    assert int((ulps > 0).sum()) <= got.numel() // 100, (
        f"group {group}: {int((ulps > 0).sum())} differ"
    )


def _bf16_ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 units in the last place, elementwise (bit patterns mapped onto one
    ordered integer line, so a step across zero counts too)."""

    def ordered(x):
        bits = x.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -32768 - bits, bits)

    return (ordered(a) - ordered(b)).abs()


@triton.jit
def _decode_rows(codes_ptr, scales_ptr, out_ptr, D: tl.constexpr):
    """One program a row: the kernel's own decode (`_e4m3_values` with the hardware
    conversion), times the row's scale, cast to the output's dtype, as the attention loads it."""
    row = tl.program_id(0)
    d = tl.arange(0, D)
    values = _e4m3_values(tl.load(codes_ptr + row * D + d), True)
    scaled = values * tl.load(scales_ptr + row)
    tl.store(out_ptr + row * D + d, scaled.to(out_ptr.dtype.element_ty))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_hardware_e4m3_decode_gives_the_reference_bytes(dtype):
    # every E4M3 code, the two NaNs (0x7F, 0xFF) replaced by +0 and -0, in each of 8 rows with
    # its own scale (fp32's smallest normal and a large one included), against the reference's
    # dequantization of the same bytes
    codes = torch.arange(256, dtype=torch.int32)
    codes = torch.where(codes == 0x7F, 0x00, torch.where(codes == 0xFF, 0x80, codes))
    codes = codes.to(torch.uint8).repeat(8, 1).to(CUDA)
    scales = torch.tensor([1.0, 2.0**-126, 2.0**-20, 0.1, 3.0, 448.0, 2.0**20, 0.75], device=CUDA)
    out = torch.empty(codes.shape, dtype=dtype, device=CUDA)
    _decode_rows[(codes.shape[0],)](codes, scales, out, D=codes.shape[1])
    assert_bytes_equal(out, dequantize_kv(codes, scales, dtype), f"{dtype}")
