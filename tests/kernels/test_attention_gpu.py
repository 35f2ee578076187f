"""The paged attention on an FP8 KV cache, compiled on a GPU: the hardware E4M3 conversion the
kernel decodes with there (`HW`) gives exactly the values the reference reads back, every code
included, so the kernel attends to an FP8 cache as to a cache holding its dequantized values,
byte for byte. GPU tier (the interpreter's integer decode: tests/kernels/test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from mxrl.engine.kv_cache import KVCache, PagedAttention
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
    assert torch.isfinite(got).all()
    assert_bytes_equal(got, _attend(plain, requests, q, group), f"{dtype} group {group}")
