"""The paged attention's launcher (mxrl.kernels.attention) and the FP8 KV cache's quantizer calls
(mxrl.nn.kv_quant), by hand: the query tiles of given requests, the rows of a program, what the
launch passes (the kernel replaced by a recorder: nothing runs), what it refuses, and which
quantizer backend a head dim gets."""

from __future__ import annotations

import pytest
import torch

import mxrl.kernels.triton_attention as ta
import mxrl.nn.kv_quant as kv_quant
from mxrl.engine.kv_cache import KVCache, PagedAttention
from mxrl.formats.constants import Format
from mxrl.kernels import Backend
from mxrl.kernels.attention import attention_tiles, block_m, paged_attention
from tests.kernels.launches import spy_launches
from tests.kernels.test_decode_gemm import interpreter
from tests.numerics import assert_bytes_equal

BS = 16


@pytest.mark.parametrize(
    ("group", "rows"),
    [(1, 16), (2, 16), (8, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64), (100, 128)],
)
def test_the_rows_of_a_program(group, rows):
    """16 (token, query head) rows, doubled until a token's group of query heads fits."""
    assert block_m(group) == rows


def test_the_tiles_of_three_requests_by_hand():
    """Group 8: 16 rows hold 2 tokens. A 5-token chunk ending at 9 keys (positions 4..8), a
    decode at position 19, and a 3-token prefill: tiles of 2 consecutive tokens, the last one
    short, each with its first token (index in T), tokens, first position and request."""
    tiles = attention_tiles([(0, 5, 9), (5, 1, 20), (6, 3, 3)], 8, "meta")
    want = {
        "token": [0, 2, 4, 5, 6, 8],
        "rows": [2, 2, 1, 1, 2, 1],
        "pos": [4, 6, 8, 19, 0, 2],
        "req": [0, 0, 0, 1, 2, 2],
    }
    for field in want:
        t = getattr(tiles, field)
        assert t.dtype == torch.int32 and t.device.type == "meta" and t.shape == (6,), field
    cpu = attention_tiles([(0, 5, 9), (5, 1, 20), (6, 3, 3)], 8, "cpu")
    assert {f: getattr(cpu, f).tolist() for f in want} == want
    assert cpu.num_tiles == 6
    # group 1: 16 tokens a tile
    one = attention_tiles([(3, 40, 40)], 1, "cpu")
    assert one.token.tolist() == [3, 19, 35] and one.rows.tolist() == [16, 16, 8]
    assert one.pos.tolist() == [0, 16, 32] and one.req.tolist() == [0, 0, 0]


def _operands(dtype=torch.float32, heads=8, heads_kv=2, d=32, dv=32, blocks=4, t=5):
    q = torch.zeros(t, heads, d, dtype=dtype)
    k = torch.zeros(blocks, BS, heads_kv, d, dtype=dtype)
    v = torch.zeros(blocks, BS, heads_kv, dv, dtype=dtype)
    return q, k, v, torch.zeros((2, blocks), dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_launch_by_hand(monkeypatch, dtype):
    """One program per (tile, key-value head); q, the caches and the output passed as they are
    (the unused scale pointers are the key cache), the strides of each; IEEE dots for fp32
    operands only, the software E4M3 decode off the GPU, four warps."""
    launches = spy_launches(monkeypatch, ta, ("paged_attention_kernel",))
    q, k, v, tables = _operands(dtype, d=24, dv=20)
    tiles = attention_tiles([(0, 3, 3), (3, 2, 40)], 4, "cpu")  # 16 rows: 4 tokens a tile
    out = paged_attention(q, k, v, tables, tiles, 0.5)
    assert out.shape == (5, 8, 20) and out.dtype == dtype
    [(name, grid, args, kw)] = launches
    assert name == "paged_attention_kernel" and grid == (2, 2)
    assert args[0] is q
    assert args[1] is k and args[2] is v and args[3] is k and args[4] is k and args[5] is out
    assert args[6] is tables and args[7:11] == (tiles.token, tiles.rows, tiles.pos, tiles.req)
    assert args[11:] == (
        8 * 24, 24, 8 * 20, 20,
        BS * 2 * 24, 2 * 24, 24, BS * 2 * 20, 2 * 20, 20,
        4, 0.5,
    )  # fmt: skip
    assert kw == dict(
        G=4, DK=24, DV=20, BLOCK_DK=32, BLOCK_DV=32, BLOCK_M=16, BLOCK_N=BS,
        IEEE=dtype == torch.float32, FP8=False, HEADS_KV=2, HW=False, num_warps=4,
    )  # fmt: skip
    assert type(kw["IEEE"]) is bool and type(kw["HW"]) is bool


def test_an_fp8_launch_passes_its_scales(monkeypatch):
    launches = spy_launches(monkeypatch, ta, ("paged_attention_kernel",))
    q, k, v, tables = _operands()
    k8, v8 = k.to(torch.uint8), v.to(torch.uint8)
    scales = (torch.ones(k.shape[:-1]), torch.ones(k.shape[:-1]))
    tiles = attention_tiles([(0, 5, 5)], 4, "cpu")
    paged_attention(q, k8, v8, tables, tiles, 1.0, fp8_scales=scales)
    [(_, grid, args, kw)] = launches
    assert grid == (2, 2) and args[1] is k8 and args[2] is v8
    assert args[3] is scales[0] and args[4] is scales[1]
    assert kw["FP8"] is True and kw["IEEE"] is True


def test_no_tiles_launch_nothing(monkeypatch):
    launches = spy_launches(monkeypatch, ta, ("paged_attention_kernel",))
    q, k, v, tables = _operands(t=0)
    tiles = attention_tiles([], 4, "cpu")
    assert paged_attention(q, k, v, tables, tiles, 1.0).shape == (0, 8, 32)
    assert launches == []


def _refused(match, q, k, v, scales=None):
    tiles = attention_tiles([(0, 1, 1)], q.shape[1] // k.shape[2], "cpu")
    tables = torch.zeros((1, k.shape[0]), dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        paged_attention(q, k, v, tables, tiles, 1.0, fp8_scales=scales)


def test_an_fp8_cache_that_does_not_fit_is_refused(monkeypatch):
    """uint8 codes for keys and values, and fp32 scales of the cache's [blocks, B, K] shape,
    contiguous: each of those wrong alone is refused."""
    spy_launches(monkeypatch, ta, ("paged_attention_kernel",))
    q, k, v, _ = _operands()
    k8, v8 = k.to(torch.uint8), v.to(torch.uint8)
    good = torch.ones(k.shape[:-1])
    for scales in (
        (good, good.half()),  # a scale's dtype
        (good, torch.ones(k.shape[:-1])[:, :8]),  # its shape
        (good, torch.ones((*k.shape[:-1], 2))[..., 0]),  # not contiguous
    ):
        _refused("an FP8 cache is uint8 codes", q, k8, v8, scales)
    _refused("an FP8 cache is uint8 codes", q, k8, v, (good, good))  # values not codes
    _refused("an FP8 cache is uint8 codes", q, k, v8, (good, good))  # keys not codes


def test_block_sizes_and_head_dims_the_kernel_does_not_take_are_refused(monkeypatch):
    spy_launches(monkeypatch, ta, ("paged_attention_kernel",))
    for blocks_of in (8, 24):  # under 16; not a power of two
        q = torch.zeros(1, 8, 32)
        k = torch.zeros(4, blocks_of, 2, 32)
        _refused("power-of-two block size >= 16", q, k, k.clone())
    q = torch.zeros(1, 8, 8)
    _refused("head dims >= 16", q, torch.zeros(4, BS, 2, 8), torch.zeros(4, BS, 2, 32))


def test_dequantized_values_in_the_dtype_asked_for():
    g = torch.Generator().manual_seed(0)
    codes, scales = kv_quant.quantize_kv(torch.randn(3, 2, 16, generator=g) * 7)
    want = kv_quant.dequantize_kv(codes, scales, torch.float32)
    got = kv_quant.dequantize_kv(codes, scales, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 2, 16)
    assert_bytes_equal(got, want.to(torch.bfloat16), "bf16")


@pytest.mark.parametrize(("d", "chosen"), [(16, "given"), (128, "given"), (24, "reference")])
def test_the_quantizer_backend_by_head_dim(monkeypatch, d, chosen):
    """A head dim the block-FP8 kernels take keeps the caller's backend; another one goes to
    the reference. One [tokens * heads, D] matrix in (1, D) blocks."""
    real = kv_quant.quantize
    calls = []

    def recorder(x, fmt, **kw):
        calls.append((tuple(x.shape), fmt, kw))
        return real(x, fmt, block=kw["block"], backend=Backend.REFERENCE)

    monkeypatch.setattr(kv_quant, "quantize", recorder)
    given = object()
    x = torch.randn(3, 2, d, generator=torch.Generator().manual_seed(1))
    codes, scales = kv_quant.quantize_kv(x, backend=given)
    want_backend = given if chosen == "given" else Backend.REFERENCE
    assert calls == [((6, d), Format.FP8_BLOCK, dict(block=(1, d), backend=want_backend))]
    assert codes.shape == (3, 2, d) and scales.shape == (3, 2)


@interpreter
def test_the_kernel_path_converts_queries_and_outputs():
    """bf16 queries over an fp32 cache on the kernel's path: q cast to the cache's dtype (the
    kernel refuses another), the output cast back to q's, close to the reference's."""
    cache = KVCache(1, 3, BS, 2, 16, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    q = torch.randn(2, 5, 16, generator=g).bfloat16()
    slots, zeros = torch.full((5,), 2 * BS), torch.zeros(2, 5, 16, dtype=torch.bfloat16)
    out = {}
    for kernel in (True, False):
        att = PagedAttention(cache, slots, [(0, 5, 5, [0])], kernel=kernel)
        out[kernel] = att(0, q, zeros, zeros)
    assert out[True].dtype == out[False].dtype == torch.bfloat16
    torch.testing.assert_close(out[True], out[False], rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize(("scratch", "chunks"), [(64 << 20, [(0, 2)]), (17408, [(0, 2)]),
                                                 (17407, [(0, 1), (1, 2)]),
                                                 (8704, [(0, 1), (1, 2)]),
                                                 (15360, [(0, 1), (1, 2)]),
                                                 (1, [(0, 1), (1, 2)])])  # fmt: skip
def test_the_split_launches_by_hand(monkeypatch, scratch, chunks):
    """split_keys 32 over 16-token blocks: 2 blocks a split, walked 2 a step (`split_step`); 64
    keys at most: 2 splits. Per tile 2 KV heads x 2 splits x 16 rows x (32 + 2) fp32 = 8,704
    bytes of scratch, so chunks of SCRATCH_BYTES // 8704 tiles (at least one): the split kernel's grid (tiles, K, splits),
    then the combine's (tiles, K), each on its chunk's tiles and one shared scratch."""
    import mxrl.kernels.attention_split as attention_split
    import mxrl.kernels.triton_attention_split as tas

    monkeypatch.setattr(attention_split, "SCRATCH_BYTES", scratch)
    launches = spy_launches(monkeypatch, tas, ("paged_attention_split_kernel",
                                               "combine_splits_kernel"))  # fmt: skip
    q, k, v, tables = _operands(torch.float32, d=24, dv=20)
    tiles = attention_tiles([(0, 3, 3), (3, 2, 40)], 4, "cpu")
    out = paged_attention(q, k, v, tables, tiles, 0.5, split_keys=32, max_keys=64)
    assert [(name, grid) for name, grid, _, _ in launches] == [
        x for a, b in chunks
        for x in (("paged_attention_split_kernel", (b - a, 2, 2)), ("combine_splits_kernel", (b - a, 2)))
    ]  # fmt: skip
    common = dict(G=4, BLOCK_DV=32, BLOCK_M=16, BLOCK_N=BS, HEADS_KV=2, SPLIT=2)
    part = launches[0][2][5]
    assert part.dtype == torch.float32 and part.shape == (chunks[0][1], 2, 2, 16, 34)
    for i, (a, b) in enumerate(chunks):
        (_, _, split_args, split_kw), (_, _, comb_args, comb_kw) = launches[2 * i : 2 * i + 2]
        assert split_args[:7] == (q, k, v, k, k, part, tables)
        for got, field in zip(split_args[7:11], ("token", "rows", "pos", "req"), strict=True):
            assert torch.equal(got, getattr(tiles, field)[a:b]), field
        assert split_args[11:] == (8 * 24, 24, BS * 2 * 24, 2 * 24, 24, BS * 2 * 20, 2 * 20,
                                   20, 4, 0.5, 2)  # fmt: skip
        assert split_kw == dict(DK=24, DV=20, BLOCK_DK=32, IEEE=True, FP8=False, HW=False,
                                STEP=2, num_warps=4, **common)  # fmt: skip
        assert comb_args[0] is part and comb_args[1] is out
        for got, field in zip(comb_args[2:5], ("token", "rows", "pos"), strict=True):
            assert torch.equal(got, getattr(tiles, field)[a:b]), field
        assert comb_args[5:] == (8 * 20, 20, 2)
        assert comb_kw == dict(DV=20, num_warps=4, **common)


def test_the_split_launch_of_bf16_operands_and_an_fp8_cache(monkeypatch):
    import mxrl.kernels.triton_attention_split as tas

    launches = spy_launches(monkeypatch, tas, ("paged_attention_split_kernel",
                                               "combine_splits_kernel"))  # fmt: skip
    q, k, v, tables = _operands(torch.bfloat16)
    tiles = attention_tiles([(0, 5, 5)], 4, "cpu")
    paged_attention(q, k, v, tables, tiles, 1.0, split_keys=16, max_keys=5)
    assert launches[0][1] == (2, 2, 1) and launches[0][3]["IEEE"] is False
    q8 = torch.zeros(5, 8, 32, dtype=torch.float32)
    scales = (torch.ones(k.shape[:-1]), torch.ones(k.shape[:-1]))
    launches.clear()
    paged_attention(q8, k.to(torch.uint8), v.to(torch.uint8), tables, tiles, 1.0, scales,
                    split_keys=48, max_keys=49)  # fmt: skip
    (_, grid, args, kw), _ = launches
    assert grid == (2, 2, 2) and kw["FP8"] is True and kw["SPLIT"] == 3
    assert args[3] is scales[0] and args[4] is scales[1]


def test_the_splits_scratch_is_fp32_on_qs_device(monkeypatch):
    """The running states are fp32 whatever the default dtype, on q's device (here `meta`:
    nothing runs)."""
    import mxrl.kernels.triton_attention_split as tas

    launches = spy_launches(monkeypatch, tas, ("paged_attention_split_kernel",
                                               "combine_splits_kernel"))  # fmt: skip
    q, k, v, tables = (t.to("meta") for t in _operands(torch.bfloat16))
    tiles = attention_tiles([(0, 5, 5)], 4, "meta")
    torch.set_default_dtype(torch.float64)
    try:
        paged_attention(q, k, v, tables, tiles, 1.0, split_keys=16, max_keys=5)
    finally:
        torch.set_default_dtype(torch.float32)
    part = launches[0][2][5]
    assert part.dtype == torch.float32 and part.device.type == "meta"
