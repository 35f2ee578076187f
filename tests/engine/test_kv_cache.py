"""The paged KV cache (mxrl.engine.kv_cache) by hand: what a token's entry holds, the cache's
sizing and allocation, its writes and reads in each dtype, the reference attention's key batches
and its softmax against scores far apart, and the attention's defaults and conversions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import mxrl.engine.kv_cache as kv_cache
from mxrl.engine.config import DEFAULT_CPU_KV_BYTES, CacheOptions
from mxrl.engine.kv_cache import KVCache, PagedAttention, cache_dims
from mxrl.nn.kv_quant import quantize_kv
from tests.numerics import assert_bytes_equal

BS, K, D = 16, 2, 16
GQA = SimpleNamespace(is_mla=False, num_key_value_heads=4, num_attention_heads=32, head_dim=128,
                      qk_nope_head_dim=0, v_head_dim=0, num_hidden_layers=3)  # fmt: skip
# DeepSeek-V3's widths: keys qk_nope + qk_rope (head_dim) = 128 + 64, values 128, every head
MLA = SimpleNamespace(is_mla=True, num_key_value_heads=1, num_attention_heads=16, head_dim=64,
                      qk_nope_head_dim=128, v_head_dim=96, num_hidden_layers=2)  # fmt: skip


def test_what_a_tokens_entry_holds():
    assert cache_dims(GQA) == (4, 128, 128)
    assert cache_dims(MLA) == (16, 192, 96)


def test_bytes_per_block_by_hand():
    # 3 layers x 16 slots x 4 heads x (128 keys + 96 values) x 2 bytes
    assert KVCache.bytes_per_block(3, 16, 4, 128, torch.bfloat16, 96) == 3 * 16 * 4 * 224 * 2
    assert KVCache.bytes_per_block(3, 16, 4, 128, torch.float32) == 3 * 16 * 4 * 256 * 4
    # fp8: a byte per element and two 4-byte scales (keys, values) per slot and head
    fp8 = KVCache.bytes_per_block(3, 16, 4, 128, torch.bfloat16, 96, fp8=True)
    assert fp8 == 3 * 16 * 4 * (224 + 8)


def _allocate(monkeypatch, config, options, device, dtype=torch.bfloat16, fp8=False, free=None):
    """KVCache.allocate on a subclass whose constructor records its arguments (nothing
    allocated: the device may be CUDA on a CPU machine); free: what mem_get_info reports."""
    made = []

    class Recorded(KVCache):
        def __init__(self, *args, **kw):
            made.append((args, kw))

    seen = []
    if free is not None:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (seen.append(d), (free, 0))[1])
    out = Recorded.allocate(config, options, torch.device(device), dtype, 1, fp8=fp8,
                            backend="the backend")  # fmt: skip
    assert type(out) is Recorded
    return made, seen


def test_allocate_from_a_given_budget(monkeypatch):
    per = KVCache.bytes_per_block(2, 16, 16, 192, torch.bfloat16, 96)
    made, _ = _allocate(monkeypatch, MLA, CacheOptions(kv_cache_bytes=10 * per + per - 1), "cpu")
    # 10 whole blocks, one of them scratch: 9 + 1 = 10 blocks, keys 192 and values 96 wide
    assert made == [((2, 10, 16, 16, 192, torch.bfloat16, torch.device("cpu"), 96),
                     dict(fp8=False, backend="the backend"))]  # fmt: skip
    per8 = KVCache.bytes_per_block(2, 16, 16, 192, torch.bfloat16, 96, fp8=True)
    made, _ = _allocate(monkeypatch, MLA, CacheOptions(kv_cache_bytes=7 * per8), "cpu", fp8=True)
    assert made[0][0][1] == 7 and made[0][1]["fp8"] is True


def test_allocate_on_cuda_takes_a_fraction_of_the_free_memory(monkeypatch):
    per = KVCache.bytes_per_block(3, 16, 4, 128, torch.bfloat16)
    options = CacheOptions(gpu_memory_fraction=0.25)
    made, seen = _allocate(monkeypatch, GQA, options, "cuda:1", free=100 * per + 7)
    assert seen == [torch.device("cuda:1")]
    assert made[0][0][1] == int((100 * per + 7) * 0.25) // per  # 25 blocks, scratch included
    assert made[0][0][6] == torch.device("cuda:1")


def test_allocate_on_the_cpu_takes_its_default(monkeypatch):
    per = KVCache.bytes_per_block(3, 16, 4, 128, torch.float32)
    made, seen = _allocate(monkeypatch, GQA, CacheOptions(), "cpu", dtype=torch.float32,
                           free=1)  # fmt: skip
    assert seen == [] and made[0][0][1] == DEFAULT_CPU_KV_BYTES // per


def test_a_budget_of_one_block_besides_the_scratch_is_enough_and_less_is_refused(monkeypatch):
    per = KVCache.bytes_per_block(3, 16, 4, 128, torch.bfloat16)
    made, _ = _allocate(monkeypatch, GQA, CacheOptions(kv_cache_bytes=2 * per), "cpu")
    assert made[0][0][1] == 2
    with pytest.raises(ValueError, match="holds no block"):
        _allocate(monkeypatch, GQA, CacheOptions(kv_cache_bytes=2 * per - 1), "cpu")


def test_a_cache_on_another_device_and_its_scales_in_fp32():
    """Every layer's tensors on the cache's device; the FP8 scales fp32 whatever the default
    dtype."""
    torch.set_default_dtype(torch.float64)
    try:
        cache = KVCache(2, 3, BS, K, D, torch.bfloat16, torch.device("meta"), 8, fp8=True)
    finally:
        torch.set_default_dtype(torch.float32)
    for held in (cache.k, cache.v, cache.k_scale, cache.v_scale):
        assert len(held) == 2 and all(t.device.type == "meta" for t in held)
    assert cache.k[0].shape == (3, BS, K, D) and cache.v[0].shape == (3, BS, K, 8)
    assert cache.k[0].dtype == torch.uint8 and cache.k_scale[1].dtype == torch.float32
    assert cache.v_scale[0].shape == (3, BS, K) and cache.v_scale[0].dtype == torch.float32
    assert cache.split_keys == 0  # one pass until the engine sets its attention_split


def test_a_write_stores_keys_and_values_in_the_caches_dtype():
    cache = KVCache(1, 2, BS, K, D, torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(K, 3, D, generator=g), torch.randn(K, 3, D, generator=g)
    slots = torch.tensor([0, 5, 17])
    cache.write(0, slots, k, v)  # fp32 in, bf16 held
    for held, x in ((cache.k[0], k), (cache.v[0], v)):
        assert_bytes_equal(held.view(-1, K, D)[slots], x.transpose(0, 1).bfloat16(), "held")
        assert held.view(-1, K, D)[1].count_nonzero() == 0


def test_an_fp8_write_quantizes_on_the_caches_backend(monkeypatch):
    calls = []

    def spy(x, backend=None):
        calls.append(backend)
        return quantize_kv(x)

    def fits(x, backend):  # the fused write (mxrl.kernels.kv_write) is asked first
        calls.append(("fused?", backend))
        return False

    monkeypatch.setattr(kv_cache, "quantize_kv", spy)
    monkeypatch.setattr(kv_cache, "fused_write_fits", fits)
    cache = KVCache(1, 2, BS, K, D, torch.float32, torch.device("cpu"), fp8=True,
                    backend="its backend")  # fmt: skip
    cache.write(0, torch.tensor([3]), torch.ones(K, 1, D), torch.ones(K, 1, D))
    assert calls == [("fused?", "its backend"), "its backend"] * 2


def test_an_fp8_gather_reads_back_in_the_compute_dtype():
    cache = KVCache(1, 2, BS, K, D, torch.bfloat16, torch.device("cpu"), fp8=True)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(K, BS, D, generator=g) * 5
    cache.write(0, torch.arange(BS, 2 * BS), k, k)
    got = cache.gather(0, True, torch.tensor([1]))
    assert got.dtype == torch.bfloat16 and got.shape == (1, BS, K, D)
    codes, scales = quantize_kv(k.transpose(0, 1).bfloat16())
    want = (codes.view(torch.float8_e4m3fn).float() * scales[..., None]).bfloat16()
    assert_bytes_equal(got[0], want, "values")


def _filled(blocks=4, seed=0, dtype=torch.float32):
    cache = KVCache(1, blocks, BS, K, D, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    return cache


def _attend_cached(cache, requests, q, scale=None, **kw):
    """Attention of tokens already in the cache: the step writes zeros to the last block (its
    scratch), which no request reads."""
    t = q.shape[1]
    scratch = (cache.k[0].shape[0] - 1) * BS
    slots = torch.full((t,), scratch, dtype=torch.long)
    zeros = torch.zeros(K, t, D, dtype=q.dtype)
    return PagedAttention(cache, slots, requests, **kw)(0, q, zeros, zeros, scale)


def _by_hand(cache, q_NTD, positions, table, scale):
    """softmax(q k^T * scale) v over a request's keys up to each position, in float64."""
    keys = torch.cat([cache.k[0][b] for b in table]).double()  # [keys, K, D]
    values = torch.cat([cache.v[0][b] for b in table]).double()
    n, _, _ = q_NTD.shape
    out = torch.empty(n, len(positions), D, dtype=torch.float64)
    for h in range(n):
        kh = h // (n // K)
        for i, p in enumerate(positions):
            s = keys[: p + 1, kh] @ q_NTD[h, i].double() * scale
            out[h, i] = torch.softmax(s, 0) @ values[: p + 1, kh]
    return out


def test_the_reference_takes_the_scale_given_and_d_to_the_minus_half_by_default():
    cache = _filled(5)
    q = torch.randn(K, 20, D, generator=torch.Generator().manual_seed(2))
    requests = [(0, 20, 20, [0, 1])]
    default = _attend_cached(cache, requests, q)
    want = _by_hand(cache, q, range(20), [0, 1], D**-0.5)
    torch.testing.assert_close(default.double(), want, rtol=1e-5, atol=1e-6)
    given = _attend_cached(cache, requests, q, scale=0.3)
    want = _by_hand(cache, q, range(20), [0, 1], 0.3)
    torch.testing.assert_close(given.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [1, 2])
def test_scores_far_apart_in_later_blocks(block):
    """The running max is taken over every block: a key in the second or third block scoring
    1000 above the others gets the whole weight, with no overflow (exp of a score minus the
    max)."""
    cache = _filled(5)
    cache.k[0][block, 3].fill_(0.0)
    cache.k[0][block, 3, :, 0] = 1000.0  # q . k = 1000 * q[0]
    q = torch.zeros(K, 1, D)
    q[:, 0, 0] = 1.0
    out = _attend_cached(cache, [(0, 1, 40, [0, 1, 2])], q, scale=1.0)
    assert torch.isfinite(out).all()
    assert_bytes_equal(out[:, 0], cache.v[0][block, 3], "the dominant key's value")


def test_bf16_sums_in_the_compute_dtype():
    """The reference sums a tile's weighted values block by block in the compute dtype (q's):
    in bf16, 16 ones then 0.1 make 16.125 (bf16's spacing at 16 is 0.125), over 17 keys of
    equal weight 16.125 / 17 = 0.9485..., which rounds to bf16 0.94921875 (an fp32 sum would
    give 16.1001 / 17 = 0.9471, rounding to 0.9453125)."""
    cache = KVCache(1, 3, BS, K, D, torch.bfloat16, torch.device("cpu"))
    cache.v[0][0].fill_(1.0)
    cache.v[0][1, 0].fill_(0.1)
    q = torch.zeros(K, 1, D, dtype=torch.bfloat16)  # every score 0: equal weights
    out = _attend_cached(cache, [(0, 1, 17, [0, 1])], q)
    assert out.dtype == torch.bfloat16
    assert out.float().unique().tolist() == [0.94921875]


def test_key_batches_of_a_small_budget_give_the_same_bytes(monkeypatch):
    """Tiles are gathered in batches while their keys fit `_GATHER_BYTES`: a tile alone when it
    does not; the bytes are the same however they are batched. The batches by hand: 4 tiles of
    one request's 16-token chunks at keys 16, 32, 48, 64 (1, 2, 3, 4 blocks)."""
    cache = _filled(6)
    q = torch.randn(K, 64, D, generator=torch.Generator().manual_seed(3))
    requests = [(0, 64, 64, [0, 1, 2, 3])]
    whole = _attend_cached(cache, requests, q)
    block_bytes = BS * K * (D + D) * 4  # keys and values of one block, fp32
    gathered = []
    real = KVCache.gather

    def spy(self, layer, values, blocks):
        if not values:
            gathered.append(tuple(blocks.shape))
        return real(self, layer, values, blocks)

    monkeypatch.setattr(KVCache, "gather", spy)
    for budget, batches in (
        (1, [(1, 1), (1, 2), (1, 3), (1, 4)]),  # under one tile's keys: a tile at a time
        (4 * block_bytes, [(2, 2), (1, 3), (1, 4)]),  # 2 tiles x 2 blocks = the budget
        (4 * block_bytes - 1, [(1, 1), (1, 2), (1, 3), (1, 4)]),
        (9 * block_bytes, [(3, 3), (1, 4)]),
        (16 * block_bytes, [(4, 4)]),
    ):
        monkeypatch.setattr(kv_cache, "_GATHER_BYTES", budget)
        gathered.clear()
        assert_bytes_equal(_attend_cached(cache, requests, q), whole, f"budget {budget}")
        assert gathered == batches, budget
    # four one-block requests: two tiles a batch, from the first tile and from the third
    requests = [(16 * i, 16, 16, [i]) for i in range(4)]
    monkeypatch.setattr(kv_cache, "_GATHER_BYTES", 2 * block_bytes)
    gathered.clear()
    _attend_cached(cache, requests, q)
    assert gathered == [(2, 1), (2, 1)]


def test_the_key_blocks_a_tile_needs_end_at_its_last_position(monkeypatch):
    """A tile whose last position is the last slot of a block needs that block, not the next."""
    cache = _filled(4)
    gathered = []
    real = KVCache.gather
    monkeypatch.setattr(
        KVCache,
        "gather",
        lambda self, layer, values, blocks: (
            gathered.append(tuple(blocks.shape)),
            real(self, layer, values, blocks),
        )[1],
    )
    q = torch.randn(K, 2, D, generator=torch.Generator().manual_seed(4))
    _attend_cached(cache, [(0, 1, 16, [0, 1]), (1, 1, 32, [0, 1])], q)  # positions 15 and 31
    assert gathered == [(2, 2), (2, 2)]  # keys, values: one batch, 2 blocks for position 31
    gathered.clear()
    _attend_cached(cache, [(0, 1, 16, [0, 1])], q[:, :1])
    assert gathered == [(1, 1), (1, 1)]


def test_queries_and_outputs_convert_to_and_from_the_caches_dtype():
    """bf16 queries over an fp32 cache: attended in fp32, returned in bf16 (the kernel's path:
    tests/kernels/test_attention_launch.py)."""
    cache = _filled(3)
    q = torch.randn(K, 5, D, generator=torch.Generator().manual_seed(5))
    want = _attend_cached(cache, [(0, 5, 5, [0])], q.bfloat16().float())
    got = _attend_cached(cache, [(0, 5, 5, [0])], q.bfloat16())
    assert got.dtype == torch.bfloat16
    assert_bytes_equal(got, want.bfloat16(), "reference")


def test_the_defaults_and_the_kernels_metadata(monkeypatch):
    cache = _filled(3)
    slots = torch.zeros(3, dtype=torch.long, device="meta")
    att = PagedAttention(cache, torch.zeros(3, dtype=torch.long), [(0, 3, 3, [0])])
    assert att.kernel is False and not hasattr(att, "tiles")
    # the kernel's tables and tiles: on the slots' device, int32, tables padded with block 0;
    # one query head a key head by default (16 tokens a tile)
    att = PagedAttention(cache, slots, [(0, 20, 20, [4, 5]), (20, 1, 40, [1, 2, 3])],
                         kernel=True)  # fmt: skip
    assert att.kernel is True
    assert att.block_tables.dtype == torch.int32 and att.block_tables.device.type == "meta"
    assert att.tiles.rows.device.type == "meta" and att.tiles.num_tiles == 3
    att = PagedAttention(cache, torch.zeros(3, dtype=torch.long),
                         [(0, 20, 20, [4, 5]), (20, 1, 40, [1, 2, 3])], kernel=True)  # fmt: skip
    assert att.block_tables.tolist() == [[4, 5, 0], [1, 2, 3]]
    assert att.tiles.rows.tolist() == [16, 4, 1]
    two = PagedAttention(cache, torch.zeros(3, dtype=torch.long), [(0, 20, 20, [4, 5])],
                         group=2, kernel=True)  # fmt: skip
    assert two.tiles.rows.tolist() == [8, 8, 4]


def test_on_device_takes_the_metadata_as_given():
    cache = _filled(2)
    slots, tables, tiles = torch.zeros(1, dtype=torch.long), torch.zeros(1, 1), object()
    att = PagedAttention.on_device(cache, slots, tables, tiles)
    assert type(att) is PagedAttention and att.kernel is True and att.requests is None
    assert att.cache is cache and att.slot_mapping is slots
    assert att.block_tables is tables and att.tiles is tiles


def test_the_kernels_path_passes_the_caches_split_and_the_tables_keys(monkeypatch):
    """The kernel's attention (the launcher replaced by a recorder) gets the cache's
    split_keys and the keys its block tables hold (width x block size)."""
    import mxrl.kernels.attention as attention

    calls = []

    def record(q, k, v, tables, tiles, scale, scales, *, split_keys=0, max_keys=0):
        calls.append((split_keys, max_keys, tables.shape[1], scale))
        return q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))

    monkeypatch.setattr(attention, "paged_attention", record)
    cache = _filled(6)
    cache.split_keys = 32
    q = torch.zeros(K, 3, D)
    att = PagedAttention(cache, torch.zeros(3, dtype=torch.long),
                         [(0, 2, 40, [0, 1, 2]), (2, 1, 5, [3])], kernel=True)  # fmt: skip
    out = att(0, q, torch.zeros(K, 3, D), torch.zeros(K, 3, D))
    assert out.shape == (K, 3, D)
    assert calls == [(32, 48, 3, D**-0.5)]
