"""The paged attention on an FP8 KV cache, compiled on a GPU. The hardware E4M3 conversion the
kernel decodes with there (`HW`), times the slot's scale and cast to the compute dtype, gives
byte for byte the keys and values the reference reads back, every code included. The attention
over them then equals the kernel's attention over a cache holding those dequantized values: byte
for byte in fp32 (an IEEE dot); in bf16 the tensor-core dot the compiler picks for keys decoded
in registers and for keys loaded from memory sums in another order, and a score's last bits can
move a bf16-rounded softmax weight by one unit, so outputs are held to the bound that follows
from that (2^-7 max|v| plus the final rounding; measured on an H200: up to 40 units of an output
near zero, 1 to 67 of 22,016 outputs moved).
GPU tier (the interpreter's integer decode: tests/kernels/test_attention.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from mxrl.engine.kv_cache import KVCache, PagedAttention
from mxrl.kernels.triton_attention import e4m3_values
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
    # bf16: the same values through another summation order of the scores' tensor-core dot
    # (module docstring). The kernel rounds the softmax weights p to bf16 for the P @ V dot, so
    # a score that differs in its last fp32 bits can move a weight across a bf16 rounding
    # boundary: one unit in its last place, at most 2^-7 of p. Over a row (weights summing to
    # 1 after the normalization, which sums them in fp32 from the unrounded values) that moves
    # an output by at most 2^-7 max|v|, and each side's final rounding to bf16 adds at most half
    # a unit of the output. On an H200: 1 to 67 of 22,016 outputs moved, by 1 to 40 units of
    # outputs near zero (a stale decode, a wrong scale or code would move them by ~max|v|).
    v_max = plain.v[0].float().abs().amax()
    bound = 2.0**-7 * v_max + _bf16_ulp(torch.maximum(got.abs(), want.abs()))
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= bound).all()), f"group {group}: {float((diff - bound).max())} past"
    moved = int((diff > 0).sum())
    assert moved <= got.numel() // 20, f"group {group}: {moved} of {got.numel()} outputs moved"


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 unit in the last place at |x| (fp32): 2^(e - 7) for |x| in [2^e, 2^(e+1)), the
    subnormal spacing below the normals."""
    e = torch.floor(torch.log2(x.float().clamp_min(2.0**-126)))
    return torch.exp2(e - 7)


@triton.jit
def _decode_rows(codes_ptr, scales_ptr, out_ptr, D: tl.constexpr):
    """One program a row: the kernel's own decode (`e4m3_values` with the hardware
    conversion), times the row's scale, cast to the output's dtype, as the attention loads it."""
    row = tl.program_id(0)
    d = tl.arange(0, D)
    values = e4m3_values(tl.load(codes_ptr + row * D + d), True)
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
