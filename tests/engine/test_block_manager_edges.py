"""Edge cases of mxrl/engine/block_manager.py that its mutation run
(docs/mutation/engine.block_manager.md) found untested: block counts at block boundaries, the
smallest cache, a cached prefix with a gap, a prefix computed twice (two blocks under one hash)
and then reused, each block's routing (not only its shape), a sequence that took part of its
prefix from the cache, and forget_prefixes with and without a block lost. Every expectation is
written out by hand from the module docstring's rules."""

from __future__ import annotations

import hashlib

import pytest
import torch

from mxrl.engine import SamplingParams
from mxrl.engine.block_manager import BlockManager, block_hashes
from mxrl.engine.sequence import Sequence


def _seq(tokens, index=0) -> Sequence:
    return Sequence(index, list(tokens), SamplingParams(), 0)


def _positions(n: int) -> torch.Tensor:
    """A routing whose row p holds p: [n, 1, 1] (which rows a block got is then visible)."""
    return torch.arange(n, dtype=torch.int64).view(n, 1, 1)


def _computed(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed = len(seq)
    rows = _positions(len(seq))
    bm.register(seq, lambda p: rows[p:])


def _take(bm: BlockManager, seq: Sequence) -> list[int]:
    cached = bm.cached_prefix(bm.prompt_hashes(seq))
    assert bm.can_admit(seq, cached, len(seq))
    bm.admit(seq, cached)
    assert bm.ensure(seq, len(seq))
    return cached


# --- sizes -------------------------------------------------------------------------------------


def test_the_smallest_cache_and_block_counts_at_the_boundaries():
    bm = BlockManager(num_blocks=1, block_size=1)
    assert bm.num_free == 1 and bm.blocks_for(1) == 1
    bm = BlockManager(num_blocks=2, block_size=4)
    assert [bm.blocks_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    for bad in ((0, 4), (4, 0)):
        with pytest.raises(ValueError):
            BlockManager(*bad)


def test_prompt_hashes_leave_out_the_last_token_s_block_at_every_boundary():
    bm = BlockManager(num_blocks=8, block_size=4)
    # 8 tokens: 2 full blocks, but the second holds the last token: 1 hash. 9 tokens: 2
    assert [len(bm.prompt_hashes(_seq(range(n)))) for n in (1, 4, 5, 8, 9, 12, 13)] == [
        0, 0, 1, 1, 2, 2, 3
    ]  # fmt: skip


def test_a_block_hash_covers_every_token_before_it():
    # the chain: block 1 of two sequences with the same block 1 tokens but different block 0
    # hashes differently; a hash is a function of the tokens only
    x, y = _seq([1, 2, 5, 6]), _seq([3, 4, 5, 6])
    hx, hy = block_hashes(x, 2, 2), block_hashes(y, 2, 2)
    assert hx[0] != hy[0] and hx[1] != hy[1]
    assert block_hashes(_seq([1, 2, 5, 6]), 2, 2) == hx
    # one full block: the hash of its tokens as int64 bytes, nothing before it
    want = hashlib.blake2b(bytes([1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]), digest_size=16)
    assert hx[0] == want.digest()
    assert block_hashes(x, 2, 1) == hx[:1]  # fewer than the sequence keeps: the first ones


def test_a_growing_sequence_hashes_each_block_once_it_is_full():
    # the hashes are kept on the sequence and extended as tokens are appended: a block's hash
    # is taken over its full tokens, never over the part of it that existed earlier
    seq = _seq(range(5))
    assert len(block_hashes(seq, 4, 1)) == 1  # block 1 holds one token so far
    seq.tokens += [5, 6, 7, 8]
    assert block_hashes(seq, 4, 2) == block_hashes(_seq(range(9), 1), 4, 2)


def test_blocks_never_handed_out_hold_no_reference():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.ref_count == [0, 0, 0, 0]
    a = _seq(range(6))
    _take(bm, a)
    assert bm.ref_count == [1, 1, 0, 0]
    bm.release(a)
    assert bm.ref_count == [0, 0, 0, 0] and list(bm.free) == [2, 3, 0, 1]


# --- the prefix cache --------------------------------------------------------------------------


def test_a_cached_prefix_stops_at_the_first_block_not_cached():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = _seq(range(9))
    assert _take(bm, a) == [] and a.block_table == [0, 1, 2]
    _computed(bm, a)
    bm.release(a)  # free: 0 1 2, blocks 0 and 1 cached
    hog = _seq([99])
    assert bm.ensure(hog, 1) and hog.block_table == [0]  # block 0 handed out: its hash goes
    assert bm.cached_prefix(bm.prompt_hashes(_seq(range(9), 1))) == []  # 1 alone is no prefix


def test_a_prefix_computed_twice_stays_cached_while_either_copy_lives():
    # a and b compute the same 9 tokens in one step (neither found it cached): both register
    # blocks 0, 1 (a) and 3, 4 (b) under the same two hashes; the first registration is kept
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = _seq(range(9), 0), _seq(range(9), 1)
    assert _take(bm, a) == [] and _take(bm, b) == []
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    _computed(bm, a)
    _computed(bm, b)
    h = bm.prompt_hashes(a)
    assert [bm.hash_to_block[x] for x in h] == [0, 1]
    assert bm.block_hash[3] == h[0] and bm.block_hash[4] == h[1]
    # b's copies are freed first and handed out again: a's registration must survive that
    bm.release(b)
    bm.release(a)
    assert list(bm.free) == [3, 4, 5, 0, 1, 2]
    hog = _seq(range(100, 108), 2)
    assert bm.ensure(hog, 8) and hog.block_table == [3, 4]
    assert bm.cached_prefix(bm.prompt_hashes(_seq(range(9), 3))) == [0, 1]
    assert bm.ref_count == [0, 0, 0, 1, 1, 0]


def test_a_block_handed_out_again_loses_its_hash_and_routing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = _seq(range(9))
    _take(bm, a)
    _computed(bm, a)
    bm.release(a)
    hog = _seq(range(50, 58), 1)
    assert bm.ensure(hog, 8) and hog.block_table == [0, 1]
    assert bm.block_hash[:2] == [None, None] and bm.hash_to_block == {}
    assert bm.routing == {}
    assert bm.ref_count == [1, 1, 0]


# --- registration and its routing ----------------------------------------------------------------


def test_each_registered_block_keeps_the_routing_of_its_own_tokens():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _seq(range(13))  # 3 full blocks + the last token's
    _take(bm, a)
    _computed(bm, a)
    assert a.num_registered == 3
    assert sorted(bm.routing) == [0, 1, 2]
    for i, b in enumerate(a.block_table[:3]):
        assert bm.routing[b].flatten().tolist() == list(range(4 * i, 4 * i + 4)), i


def test_registering_after_a_cached_prefix_asks_routing_from_the_first_new_block():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = _seq(range(5))  # one full block, then the last token's
    _take(bm, a)
    _computed(bm, a)
    b = _seq([*range(5), 10, 11, 12, 13, 14], 1)  # shares a's block 0; 2 full blocks
    assert _take(bm, b) == [0]
    assert b.block_table == [0, 2, 3] and b.num_computed == 4 and b.num_registered == 1
    asked = []

    def routing(p):
        asked.append(p)
        return _positions(len(b))[p:]

    b.num_computed = len(b)
    bm.register(b, routing)
    assert asked == [4]  # block 0 is registered already: only block 1 (positions 4..7) is new
    assert b.num_registered == 2
    assert bm.routing[2].flatten().tolist() == [4, 5, 6, 7]
    assert bm.routing[0].flatten().tolist() == [0, 1, 2, 3]  # a's, untouched


def test_register_with_nothing_newly_full_asks_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _seq(range(6))

    def routing(p):
        raise AssertionError(f"routing asked from {p}")

    _take(bm, a)
    a.num_computed = 3  # no block full yet
    bm.register(a, routing)
    assert a.num_registered == 0 and bm.hash_to_block == {}
    a.num_computed = 4  # block 0 full now
    bm.register(a, lambda p: _positions(6)[p:])
    assert a.num_registered == 1 and list(bm.hash_to_block.values()) == [0]
    a.num_computed = 6  # a decode step inside block 1: nothing newly full
    bm.register(a, routing)
    assert a.num_registered == 1


def test_a_block_already_hashed_is_not_registered_again():
    # "a block already registered under its hash keeps that registration": b holds a's block
    # 0 from the cache; with its count of registered blocks behind (set back by hand), the
    # block is not hashed again and its routing is not asked for
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _seq(range(5))
    _take(bm, a)
    _computed(bm, a)
    b = _seq(range(5), 1)
    assert _take(bm, b) == [0]
    b.num_registered = 0

    def routing(p):
        raise AssertionError(f"routing asked from {p}")

    b.num_computed = 5
    bm.register(b, routing)
    assert b.num_registered == 1


# --- forget_prefixes -----------------------------------------------------------------------------


def test_forget_prefixes_keeps_the_free_order_when_every_block_is_free():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _seq(range(9))
    _take(bm, a)
    _computed(bm, a)
    bm.release(a)
    assert list(bm.free) == [3, 0, 1, 2]
    registered = dict(bm.routing)
    bm.forget_prefixes()
    assert list(bm.free) == [3, 0, 1, 2]
    assert bm.hash_to_block == {} and bm.block_hash == [None] * 4
    assert bm.cached_prefix(bm.prompt_hashes(_seq(range(9), 1))) == []
    # the routing entries are not freed here (one host tensor each, inside every weight
    # update) but when their blocks are handed out again: none is reachable meanwhile
    assert bm.routing.keys() == registered.keys() == {0, 1}
    again = _seq(range(100, 109), 2)
    assert bm.ensure(again, 9) and again.block_table == [3, 0, 1]
    assert bm.routing == {}


def test_forget_prefixes_frees_a_block_a_failed_call_lost():
    bm = BlockManager(num_blocks=4, block_size=4)
    lost = _seq(range(9))
    _take(bm, lost)
    _computed(bm, lost)  # never released: its call failed
    assert bm.num_free == 1
    bm.forget_prefixes()
    assert bm.ref_count == [0, 0, 0, 0] and list(bm.free) == [0, 1, 2, 3]
    assert bm.hash_to_block == {} and bm.block_hash == [None] * 4
