"""The block manager's reference counts and free list when sequences share prefix blocks: every
expectation is written out by hand, or counted by a plain model of the rule (a block is free
exactly when no sequence holds it; it joins the free list when its last holder lets it go, in
the order of that holder's block table; blocks are handed out oldest freed first)."""

from __future__ import annotations

import itertools

import pytest
import torch

from mxrl.engine import SamplingParams
from mxrl.engine.block_manager import BlockManager
from mxrl.engine.sequence import Sequence


def _seq(tokens, index=0) -> Sequence:
    return Sequence(index, list(tokens), SamplingParams(), 0)


def _computed(bm: BlockManager, seq: Sequence) -> None:
    """The step computed every token of `seq`: its full blocks become shareable."""
    seq.num_computed = len(seq)
    bm.register(seq, lambda p: torch.zeros((len(seq) - p, 1, 1), dtype=torch.int64))


def _take(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit `seq` with whatever prefix the cache holds, then give it blocks for its tokens."""
    cached = bm.cached_prefix(bm.prompt_hashes(seq))
    assert bm.can_admit(seq, cached, len(seq))
    bm.admit(seq, cached)
    assert bm.ensure(seq, len(seq))
    return cached


# Three sequences on a 6-block cache of 4-token blocks:
#   a = 0..9            -> blocks 0 1 2 (0 and 1 full, registered)
#   b = 0..9            -> takes 0 1 from the cache, 3 new
#   c = 0..3 50..53 60  -> shares block 0 only (same first 4 tokens), 4 5 new
A, B, C = list(range(10)), list(range(10)), [0, 1, 2, 3, 50, 51, 52, 53, 60]
TABLES = {"a": [0, 1, 2], "b": [0, 1, 3], "c": [0, 4, 5]}


def _three() -> tuple[BlockManager, dict[str, Sequence]]:
    bm = BlockManager(num_blocks=6, block_size=4)
    seqs = {"a": _seq(A, 0), "b": _seq(B, 1), "c": _seq(C, 2)}
    assert _take(bm, seqs["a"]) == []
    _computed(bm, seqs["a"])
    assert _take(bm, seqs["b"]) == [0, 1]
    assert _take(bm, seqs["c"]) == [0]
    for name, seq in seqs.items():
        assert seq.block_table == TABLES[name], name
    assert bm.ref_count == [3, 2, 1, 1, 1, 1]
    assert list(bm.free) == []
    return bm, seqs


def test_a_shared_block_stays_held_until_its_last_holder_releases_it():
    bm, seqs = _three()
    bm.release(seqs["a"])  # block 0 still held by b and c, block 1 by b: only 2 is free
    assert bm.ref_count == [2, 1, 0, 1, 1, 1]
    assert list(bm.free) == [2]
    bm.release(seqs["b"])  # block 1 and 3 reach zero, in b's table order
    assert bm.ref_count == [1, 0, 0, 0, 1, 1]
    assert list(bm.free) == [2, 1, 3]
    bm.release(seqs["c"])
    assert bm.ref_count == [0] * 6
    assert list(bm.free) == [2, 1, 3, 0, 4, 5]
    assert all(s.block_table == [] for s in seqs.values())


@pytest.mark.parametrize("order", list(itertools.permutations("abc")))
def test_refcounts_and_free_order_under_every_release_order(order):
    """After each release: a block's count is the number of sequences still holding it, and
    the free list holds the blocks nobody holds, in the order they were let go."""
    bm, seqs = _three()
    held = dict(TABLES)
    want_free: list[int] = []
    for name in order:
        bm.release(seqs[name])
        table = held.pop(name)
        want_free += [b for b in table if not any(b in t for t in held.values())]
        want_counts = [sum(b in t for t in held.values()) for b in range(6)]
        assert bm.ref_count == want_counts, (order, name)
        assert list(bm.free) == want_free, (order, name)


def test_a_freed_shared_block_is_taken_back_then_reused_only_when_handed_out_again():
    bm, seqs = _three()
    bm.release(seqs["a"])
    bm.release(seqs["b"])  # free: 2 1 3; block 1 keeps its hash, block 0 is held by c
    d = _seq(range(10), 3)
    assert bm.cached_prefix(bm.prompt_hashes(d)) == [0, 1]
    # needs 3 blocks: 0 (held), 1 (free but cached: taken back), one new (2, the oldest freed)
    assert _take(bm, d) == [0, 1]
    assert d.block_table == [0, 1, 2]
    assert bm.ref_count == [2, 1, 1, 0, 1, 1]
    assert list(bm.free) == [3]
    assert d.num_computed == 8 and d.num_registered == 2
    bm.release(d)
    bm.release(seqs["c"])
    assert bm.ref_count == [0] * 6
    assert list(bm.free) == [3, 1, 2, 0, 4, 5]
    # a fresh sequence takes the four oldest freed blocks (3 1 2 0): the prefix's blocks 1
    # and 0 are overwritten, so the prefix is gone; 4 and 5 are left, in order
    e = _seq(range(100, 116), 4)
    assert bm.ensure(e, 16) and e.block_table == [3, 1, 2, 0]
    assert bm.ref_count == [1, 1, 1, 1, 0, 0] and list(bm.free) == [4, 5]
    assert bm.cached_prefix(bm.prompt_hashes(_seq(range(10), 5))) == []
    assert bm.block_hash[0] is None and bm.block_hash[1] is None


def test_can_admit_counts_cached_blocks_taken_back_from_the_free_list():
    bm, seqs = _three()
    bm.release(seqs["a"])
    bm.release(seqs["b"])  # free: 2 1 3 (1 cached); c holds 0 4 5
    d = _seq(range(10), 3)
    assert bm.cached_prefix(bm.prompt_hashes(d)) == [0, 1]
    hog = _seq(range(200, 208), 4)
    assert bm.ensure(hog, 8) and hog.block_table == [2, 1]  # 1 is gone: prefix 0 only now
    assert bm.cached_prefix(bm.prompt_hashes(d)) == [0]
    assert list(bm.free) == [3]
    # 3 blocks needed, 1 shared (held by c): 2 new, 1 free -> refused
    assert not bm.can_admit(d, [0], 10)
    # the two-block prompt 0..4: 2 needed, 1 shared, 1 new == 1 free -> admitted
    assert bm.can_admit(_seq(range(5), 6), [0], 5)


def test_can_admit_when_a_cached_block_is_itself_free():
    """A cached block with no holder is counted once: it leaves the free list when taken."""
    bm = BlockManager(num_blocks=3, block_size=4)
    a = _seq(range(9), 0)  # 2 full blocks + the last token's
    assert _take(bm, a) == [] and a.block_table == [0, 1, 2]
    _computed(bm, a)
    bm.release(a)  # free: 0 1 2, blocks 0 and 1 cached
    b = _seq(range(9), 1)
    cached = bm.cached_prefix(bm.prompt_hashes(b))
    assert cached == [0, 1]
    assert bm.can_admit(b, cached, 9)  # 3 needed, 2 cached (free), 1 new: 3 free - 2 = 1
    assert not bm.can_admit(b, cached, 13)  # 4 needed: 2 new > 1
    bm.admit(b, cached)
    assert bm.ref_count == [1, 1, 0] and list(bm.free) == [2]
