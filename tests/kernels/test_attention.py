"""The Triton paged attention (mxrl.kernels.attention) under Triton's interpreter: close to the
reference of mxrl.engine.kv_cache, and batch- and chunk-invariant bit for bit. The GPU tier
(tests/engine/test_gpu.py) runs the engine on it compiled."""

from __future__ import annotations

import pytest
import torch

from mxrl.engine.kv_cache import KVCache, PagedAttention
from tests.kernels.test_decode_gemm import interpreter
from tests.numerics import assert_bytes_equal

BS, KV_HEADS, D = 16, 2, 16


def _cache(num_blocks=12, seed=0):
    cache = KVCache(1, num_blocks, BS, KV_HEADS, D, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    return cache


def _run(cache, requests, q, kernel, group):
    """Attention of new tokens that are already in the cache: the step writes back the keys
    and values the cache holds at their slots (so the write changes nothing)."""
    bs = cache.block_size
    slots, ks, vs = [], [], []
    for _start, n, kv_len, table in requests:
        for p in range(kv_len - n, kv_len):
            slot = table[p // bs] * bs + p % bs
            slots.append(slot)
            ks.append(cache.k[0].view(-1, KV_HEADS, D)[slot])
            vs.append(cache.v[0].view(-1, KV_HEADS, D)[slot])
    k = torch.stack(ks).transpose(0, 1)
    v = torch.stack(vs).transpose(0, 1)
    att = PagedAttention(cache, torch.tensor(slots), requests, group=group, kernel=kernel)
    return att(0, q, k, v)


@interpreter
@pytest.mark.parametrize("group", [1, 4])
def test_kernel_matches_the_reference(group):
    cache = _cache()
    heads = KV_HEADS * group
    g = torch.Generator().manual_seed(1)
    # a 37-token prefill, a 1-token decode at position 20, a 5-token chunk at 40..44
    requests = [(0, 37, 37, [0, 1, 2]), (37, 1, 21, [3, 4]), (38, 5, 45, [5, 6, 7])]
    q = torch.randn(heads, 43, D, generator=g)
    want = _run(cache, requests, q, kernel=False, group=group)
    got = _run(cache, requests, q, kernel=True, group=group)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreter
def test_kernel_is_batch_and_chunk_invariant():
    cache = _cache()
    group = 2
    g = torch.Generator().manual_seed(2)
    q = torch.randn(KV_HEADS * group, 37, D, generator=g)
    table = [0, 1, 2]
    whole = _run(cache, [(0, 37, 37, table)], q, kernel=True, group=group)
    # the same request beside another one, and its tokens in chunks of 5, 20 and 12
    other = torch.randn(KV_HEADS * group, 9, D, generator=g)
    batched = _run(
        cache,
        [(0, 9, 30, [8, 9]), (9, 37, 37, table)],
        torch.cat([other, q], dim=1),
        kernel=True,
        group=group,
    )
    assert_bytes_equal(batched[:, 9:], whole, "beside another request")
    start = 0
    for n in (5, 20, 12):
        chunk = _run(cache, [(0, n, start + n, table)], q[:, start : start + n], True, group)
        assert_bytes_equal(chunk, whole[:, start : start + n], f"chunk {start}..{start + n}")
        start += n


def _fp8_pair(seed=0):
    """An FP8 cache written with random keys and values, and a compute-dtype cache holding
    exactly what the FP8 one gives back (its dequantized values)."""
    fp8 = KVCache(1, 12, BS, KV_HEADS, D, torch.float32, torch.device("cpu"), fp8=True)
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(12 * BS)
    k = torch.randn(KV_HEADS, 12 * BS, D, generator=g) * 3
    v = torch.randn(KV_HEADS, 12 * BS, D, generator=g) / 5
    fp8.write(0, slots, k, v)
    plain = KVCache(1, 12, BS, KV_HEADS, D, torch.float32, torch.device("cpu"))
    everything = torch.arange(12)
    plain.k[0].copy_(fp8.gather(0, False, everything))
    plain.v[0].copy_(fp8.gather(0, True, everything))
    return fp8, plain


def _attend_cached(cache, requests, q, kernel, group):
    """Attention of new tokens already in the cache (a step that writes nothing new: its slots
    are the cache's own scratch, block 11, never read)."""
    t = q.shape[1]
    slots = torch.full((t,), 11 * BS, dtype=torch.long)
    zeros = torch.zeros(KV_HEADS, t, D)
    att = PagedAttention(cache, slots, requests, group=group, kernel=kernel)
    return att(0, q, zeros, zeros)


@interpreter
@pytest.mark.parametrize("group", [1, 4])
def test_kernel_on_an_fp8_cache_attends_to_its_dequantized_values(group):
    """`kv_cache: fp8`: the kernel decodes codes times scales to exactly the values the
    reference reads back, so it gives what it gives on a cache holding those values."""
    fp8, plain = _fp8_pair()
    g = torch.Generator().manual_seed(3)
    requests = [(0, 37, 37, [0, 1, 2]), (37, 1, 21, [3, 4]), (38, 5, 45, [5, 6, 7])]
    q = torch.randn(KV_HEADS * group, 43, D, generator=g)
    got = _attend_cached(fp8, requests, q, kernel=True, group=group)
    assert_bytes_equal(got, _attend_cached(plain, requests, q, True, group), "kernel")
    ref = _attend_cached(fp8, requests, q, kernel=False, group=group)
    assert_bytes_equal(ref, _attend_cached(plain, requests, q, False, group), "reference")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _mla_cache(dk, dv, fp8=False, seed=0):
    """A cache whose keys (DK) and values (DV) differ in width, as MLA's do (DeepSeek-V3:
    qk_nope + qk_rope = 192, v_head_dim 128), written with random keys and values."""
    cache = KVCache(1, 12, BS, KV_HEADS, dk, torch.float32, torch.device("cpu"), dv, fp8=fp8)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(KV_HEADS, 12 * BS, dk, generator=g) * 2
    v = torch.randn(KV_HEADS, 12 * BS, dv, generator=g)
    cache.write(0, torch.arange(12 * BS), k, v)
    return cache


def _attend_mla(cache, requests, q, kernel):
    """_attend_cached for a cache of narrower values: the step's own write goes to the scratch
    block 11 (never read)."""
    t = q.shape[1]
    slots = torch.full((t,), 11 * BS, dtype=torch.long)
    dk, dv = cache.k[0].shape[-1], cache.v[0].shape[-1]
    att = PagedAttention(cache, slots, requests, group=1, kernel=kernel)
    return att(0, q, torch.zeros(KV_HEADS, t, dk), torch.zeros(KV_HEADS, t, dv), scale=dk**-0.4)


# (DK, DV): MLA-like widths that are not powers of two (padded inside the kernel), and a power
# of two for keys only
MLA_DIMS = [(24, 16), (48, 20), (32, 16)]


@interpreter
@pytest.mark.parametrize(("dk", "dv"), MLA_DIMS)
def test_kernel_takes_keys_and_values_of_other_widths(dk, dv):
    """MLA's cache: keys DK wide, values DV, neither need be a power of two; the kernel's
    output is [T, N, DV], close to the reference, and a request's bytes are the same alone,
    beside another one and in chunks."""
    cache = _mla_cache(dk, dv)
    g = torch.Generator().manual_seed(4)
    requests = [(0, 37, 37, [0, 1, 2]), (37, 1, 21, [3, 4]), (38, 5, 45, [5, 6, 7])]
    q = torch.randn(KV_HEADS, 43, dk, generator=g)
    want = _attend_mla(cache, requests, q, kernel=False)
    got = _attend_mla(cache, requests, q, kernel=True)
    assert got.shape == want.shape == (KV_HEADS, 43, dv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = _attend_mla(cache, [(0, 37, 37, [0, 1, 2])], q[:, :37], kernel=True)
    assert_bytes_equal(got[:, :37], alone, "beside others")
    chunk = _attend_mla(cache, [(0, 20, 32, [0, 1])], q[:, 12:32], kernel=True)
    assert_bytes_equal(chunk, alone[:, 12:32], "a chunk at 12..31")


@interpreter
@pytest.mark.parametrize(("dk", "dv"), MLA_DIMS[:2])
def test_kernel_on_an_fp8_cache_of_other_widths_reads_its_dequantized_values(dk, dv):
    """The FP8 cache with MLA's widths: the padded columns decode to zeros, so the kernel gives
    what it gives on a cache holding the dequantized values, byte for byte."""
    fp8 = _mla_cache(dk, dv, fp8=True)
    plain = KVCache(1, 12, BS, KV_HEADS, dk, torch.float32, torch.device("cpu"), dv)
    everything = torch.arange(12)
    plain.k[0].copy_(fp8.gather(0, False, everything))
    plain.v[0].copy_(fp8.gather(0, True, everything))
    g = torch.Generator().manual_seed(5)
    requests = [(0, 37, 37, [0, 1, 2]), (37, 1, 21, [3, 4])]
    q = torch.randn(KV_HEADS, 38, dk, generator=g)
    got = _attend_mla(fp8, requests, q, kernel=True)
    assert_bytes_equal(got, _attend_mla(plain, requests, q, kernel=True), "fp8 vs dequantized")
    torch.testing.assert_close(
        got, _attend_mla(fp8, requests, q, kernel=False), rtol=1e-5, atol=1e-5
    )


def test_the_kernel_refuses_what_does_not_fit():
    from mxrl.kernels.attention import attention_tiles, paged_attention

    tiles = attention_tiles([(0, 1, 1)], 1, torch.device("cpu"))
    tables = torch.zeros((1, 1), dtype=torch.int32)
    k = torch.zeros(2, BS, KV_HEADS, 24)
    with pytest.raises(ValueError, match="does not fit the cache"):  # q's width is not the keys'
        paged_attention(
            torch.zeros(1, KV_HEADS, 16), k, torch.zeros(2, BS, KV_HEADS, 16), tables, tiles, 1.0
        )
    with pytest.raises(ValueError, match="does not fit the cache"):  # values of other blocks
        paged_attention(
            torch.zeros(1, KV_HEADS, 24), k, torch.zeros(3, BS, KV_HEADS, 16), tables, tiles, 1.0
        )
    with pytest.raises(ValueError, match="head dims >= 16"):
        paged_attention(
            torch.zeros(1, KV_HEADS, 24), k, torch.zeros(2, BS, KV_HEADS, 8), tables, tiles, 1.0
        )
