"""The split-keys paged attention (mxrl/kernels/triton_attention_split.py) under Triton's
interpreter: close to the reference, the one-pass kernel's bytes where a request fits in one
split, and batch-, chunk- and decode-invariant bit for bit where it does not, on bf16-width, FP8
and MLA caches, whatever the scratch's chunking."""

from __future__ import annotations

import pytest
import torch

import mxrl.kernels.attention_split as attention_split
from mxrl.engine.kv_cache import KVCache, PagedAttention
from mxrl.kernels.attention import attention_tiles, paged_attention
from tests.kernels.test_attention import _mla_cache
from tests.kernels.test_decode_gemm import interpreter
from tests.numerics import assert_bytes_equal

BS, KV_HEADS = 16, 2
# a 37-token prefill, a 1-token decode at position 20, a 5-token chunk at 40..44
REQUESTS = [(0, 37, 37, [0, 1, 2]), (37, 1, 21, [3, 4]), (38, 5, 45, [5, 6, 7])]


def _cache(dk=16, dv=16, fp8=False, seed=0):
    return _mla_cache(dk, dv, fp8, seed)  # keys x2, values as drawn: test_attention.py's


def _attend(cache, requests, q_NTD, group, split_keys=0):
    """The kernel's attention of tokens already in the cache, [N, T, DV]."""
    width = max(len(r[3]) for r in requests)
    tables = torch.tensor([r[3] + [0] * (width - len(r[3])) for r in requests], dtype=torch.int32)
    tiles = attention_tiles([r[:3] for r in requests], group, "cpu")
    scales = (cache.k_scale[0], cache.v_scale[0]) if cache.fp8 else None
    max_keys = max(r[2] for r in requests)
    q = q_NTD.transpose(0, 1).contiguous()
    out = paged_attention(q, cache.k[0], cache.v[0], tables, tiles, q.shape[-1] ** -0.5, scales,
                          split_keys=split_keys, max_keys=max_keys)  # fmt: skip
    return out.transpose(0, 1)


def _reference(cache, requests, q_NTD, group):
    t = q_NTD.shape[1]
    slots = torch.full((t,), 11 * BS, dtype=torch.long)
    dk, dv = cache.k[0].shape[-1], cache.v[0].shape[-1]
    att = PagedAttention(cache, slots, requests, group=group)
    zeros_k, zeros_v = torch.zeros(KV_HEADS, t, dk), torch.zeros(KV_HEADS, t, dv)
    return att(0, q_NTD, zeros_k, zeros_v)


@interpreter
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("split_keys", [16, 32])
def test_close_to_the_reference(group, split_keys):
    cache = _cache()
    q = torch.randn(KV_HEADS * group, 43, 16, generator=torch.Generator().manual_seed(1))
    got = _attend(cache, REQUESTS, q, group, split_keys)
    torch.testing.assert_close(got, _reference(cache, REQUESTS, q, group), rtol=1e-5, atol=1e-5)


@interpreter
def test_within_one_split_the_one_pass_kernels_bytes():
    """One split holding every key: its state merged into nothing is itself (x * 1 + 0)."""
    cache = _cache()
    q = torch.randn(KV_HEADS * 2, 43, 16, generator=torch.Generator().manual_seed(2))
    assert_bytes_equal(_attend(cache, REQUESTS, q, 2, 48), _attend(cache, REQUESTS, q, 2), "48")


@interpreter
@pytest.mark.parametrize("split_keys", [16, 32])
def test_batch_chunk_and_decode_invariant(split_keys):
    """A 45-token request alone, beside another one, in chunks that cross split boundaries,
    and one token at a time (decode): the same bytes."""
    cache = _cache()
    group = 2
    g = torch.Generator().manual_seed(3)
    q = torch.randn(KV_HEADS * group, 45, 16, generator=g)
    table = [0, 1, 2]
    whole = _attend(cache, [(0, 45, 45, table)], q, group, split_keys)
    other = torch.randn(KV_HEADS * group, 9, 16, generator=g)
    batched = _attend(cache, [(0, 9, 30, [8, 9]), (9, 45, 45, table)],
                      torch.cat([other, q], dim=1), group, split_keys)  # fmt: skip
    assert_bytes_equal(batched[:, 9:], whole, "beside another request")
    start = 0
    for n in (15, 2, 16, 1, 11):  # chunks ending at 15, 17, 33, 34, 45
        chunk = _attend(cache, [(0, n, start + n, table)], q[:, start : start + n], group,
                        split_keys)  # fmt: skip
        assert_bytes_equal(chunk, whole[:, start : start + n], f"chunk {start}..{start + n}")
        start += n
    for p in (0, 15, 16, 31, 32, 44):  # decode steps, at and around the split boundaries
        step = _attend(cache, [(0, 1, p + 1, table)], q[:, p : p + 1], group, split_keys)
        assert_bytes_equal(step, whole[:, p : p + 1], f"decode at {p}")


def test_a_step_walks_4_blocks_where_they_divide_the_split_else_2_else_1():
    assert [attention_split.split_step(n) for n in (1, 2, 3, 4, 6, 8, 12, 32, 5)] == [
        1, 2, 1, 4, 2, 4, 4, 4, 1,
    ]  # fmt: skip


@interpreter
@pytest.mark.parametrize("fp8", [False, True])
def test_four_blocks_a_step_batch_chunk_and_decode_invariant(fp8):
    """64-key splits walked 4 blocks a step: a 150-token request (blocks 0-9: the last split's
    step holds 2 blocks and 2 past the request) alone, beside another request, in chunks across
    split and step boundaries and one token at a time: the same bytes, close to the reference."""
    cache = _cache(fp8=fp8)
    group = 2
    g = torch.Generator().manual_seed(4)
    q = torch.randn(KV_HEADS * group, 150, 16, generator=g)
    table = list(range(10))
    whole = _attend(cache, [(0, 150, 150, table)], q, group, 64)
    torch.testing.assert_close(
        whole, _reference(cache, [(0, 150, 150, table)], q, group), rtol=1e-5, atol=1e-5
    )
    other = torch.randn(KV_HEADS * group, 7, 16, generator=g)
    batched = _attend(cache, [(0, 7, 20, [10, 11]), (7, 150, 150, table)],
                      torch.cat([other, q], dim=1), group, 64)  # fmt: skip
    assert_bytes_equal(batched[:, 7:], whole, "beside another request")
    start = 0
    for n in (50, 14, 1, 66, 19):  # chunks ending at 50, 64, 65, 131, 150
        chunk = _attend(cache, [(0, n, start + n, table)], q[:, start : start + n], group, 64)
        assert_bytes_equal(chunk, whole[:, start : start + n], f"chunk {start}..{start + n}")
        start += n
    for p in (0, 15, 16, 63, 64, 127, 128, 149):  # decode steps around steps and splits
        step = _attend(cache, [(0, 1, p + 1, table)], q[:, p : p + 1], group, 64)
        assert_bytes_equal(step, whole[:, p : p + 1], f"decode at {p}")


@interpreter
def test_an_fp8_cache_attends_to_its_dequantized_values():
    fp8 = _cache(fp8=True)
    plain = KVCache(1, 12, BS, KV_HEADS, 16, torch.float32, torch.device("cpu"))
    everything = torch.arange(12)
    plain.k[0].copy_(fp8.gather(0, False, everything))
    plain.v[0].copy_(fp8.gather(0, True, everything))
    q = torch.randn(KV_HEADS * 4, 43, 16, generator=torch.Generator().manual_seed(4))
    got = _attend(fp8, REQUESTS, q, 4, 16)
    assert_bytes_equal(got, _attend(plain, REQUESTS, q, 4, 16), "fp8 vs its values")
    torch.testing.assert_close(got, _reference(fp8, REQUESTS, q, 4), rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize(("dk", "dv"), [(24, 16), (48, 20)])
def test_keys_and_values_of_other_widths(dk, dv):
    """MLA's widths (padded inside the kernel): [T, N, DV] out, close to the reference, the
    same bytes alone and in a chunk."""
    cache = _cache(dk, dv)
    q = torch.randn(KV_HEADS, 43, dk, generator=torch.Generator().manual_seed(5))
    got = _attend(cache, REQUESTS, q, 1, 16)
    assert got.shape == (KV_HEADS, 43, dv)
    want = PagedAttention(cache, torch.full((43,), 11 * BS), REQUESTS)(
        0, q, torch.zeros(KV_HEADS, 43, dk), torch.zeros(KV_HEADS, 43, dv), dk**-0.5
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    chunk = _attend(cache, [(0, 20, 32, [0, 1])], q[:, 12:32], 1, 16)
    alone = _attend(cache, [(0, 37, 37, [0, 1, 2])], q[:, :37], 1, 16)
    assert_bytes_equal(chunk, alone[:, 12:32], "a chunk at 12..31")


@interpreter
def test_the_scratch_in_chunks_of_tiles_gives_the_same_bytes(monkeypatch):
    cache = _cache()
    q = torch.randn(KV_HEADS * 4, 43, 16, generator=torch.Generator().manual_seed(6))
    whole = _attend(cache, REQUESTS, q, 4, 16)
    monkeypatch.setattr(attention_split, "SCRATCH_BYTES", 1)  # a tile a launch
    assert_bytes_equal(_attend(cache, REQUESTS, q, 4, 16), whole, "a tile a launch")


def test_split_keys_the_kernel_does_not_take_are_refused():
    cache = _cache()
    tiles = attention_tiles([(0, 1, 1)], 1, "cpu")
    tables = torch.zeros((1, 1), dtype=torch.int32)
    q = torch.zeros(1, KV_HEADS, 16)
    for split_keys, max_keys in ((24, 1), (-16, 1), (16, 0)):
        with pytest.raises(ValueError, match="split_keys must be a positive multiple"):
            paged_attention(q, cache.k[0], cache.v[0], tables, tiles, 1.0,
                            split_keys=split_keys, max_keys=max_keys)  # fmt: skip
    with pytest.raises(ValueError, match="and max_keys >= 1, got 16 and 0"):  # max_keys unsaid
        paged_attention(q, cache.k[0], cache.v[0], tables, tiles, 1.0, split_keys=16)


def _cuda_cache(dtype, fp8=False):
    cache = KVCache(1, 24, BS, KV_HEADS, 128, dtype, torch.device("cuda"), fp8=fp8)
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(KV_HEADS, 24 * BS, 128, generator=g, device="cuda") * 2
    v = torch.randn(KV_HEADS, 24 * BS, 128, generator=g, device="cuda")
    cache.write(0, torch.arange(24 * BS, device="cuda"), k, v)
    return cache


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_batch_chunk_and_decode_invariant(dtype, fp8):
    """Compiled: a 300-token request (three 128-key splits, tables of 19 blocks) alone, beside
    another, in chunks across split boundaries and decoded token by token: the same bytes;
    close to the one-pass kernel."""
    cache = _cuda_cache(dtype, fp8)
    group = 8
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(KV_HEADS * group, 300, 128, generator=g, device="cuda").to(dtype)
    table = list(range(19))
    whole = _attend_cuda(cache, [(0, 300, 300, table)], q, group)
    other = torch.randn(KV_HEADS * group, 7, 128, generator=g, device="cuda").to(dtype)
    batched = _attend_cuda(cache, [(0, 7, 50, [20, 21, 22, 23]), (7, 300, 300, table)],
                           torch.cat([other, q], dim=1), group)  # fmt: skip
    assert_bytes_equal(batched[:, 7:], whole, "beside another request")
    start = 0
    for n in (127, 2, 129, 42):
        chunk = _attend_cuda(cache, [(0, n, start + n, table)], q[:, start : start + n], group)
        assert_bytes_equal(chunk, whole[:, start : start + n], f"chunk {start}..{start + n}")
        start += n
    for p in (0, 127, 128, 255, 256, 299):
        step = _attend_cuda(cache, [(0, 1, p + 1, table)], q[:, p : p + 1], group)
        assert_bytes_equal(step, whole[:, p : p + 1], f"decode at {p}")
    one_pass = _attend_cuda(cache, [(0, 300, 300, table)], q, group, split_keys=0)
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    torch.testing.assert_close(whole.float(), one_pass.float(), rtol=tol, atol=tol)


def _attend_cuda(cache, requests, q_NTD, group, split_keys=128):
    width = max(len(r[3]) for r in requests)
    tables = torch.tensor([r[3] + [0] * (width - len(r[3])) for r in requests],
                          dtype=torch.int32, device="cuda")  # fmt: skip
    tiles = attention_tiles([r[:3] for r in requests], group, "cuda")
    scales = (cache.k_scale[0], cache.v_scale[0]) if cache.fp8 else None
    q = q_NTD.transpose(0, 1).contiguous()
    out = paged_attention(q, cache.k[0], cache.v[0], tables, tiles, 128**-0.5, scales,
                          split_keys=split_keys, max_keys=width * BS)  # fmt: skip
    return out.transpose(0, 1)
