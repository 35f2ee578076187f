"""The paged KV cache's bookkeeping: fixed-size blocks, per-sequence block tables, and prefix
sharing by content hash (the n samples of one GRPO prompt reuse its KV blocks).

A block holds the keys/values of `block_size` consecutive tokens of one sequence. A *full* block
whose keys/values are computed is registered under a hash of its tokens and of every token
before it (a chain), so a later sequence with the same prefix takes the block instead of
computing it again. Blocks are reference-counted; a freed block keeps its hash until it is
handed out again (oldest freed first), so a prefix stays reusable for a while after its
sequence finished.

Sharing is exact: the engine's forward is batch- and chunk-invariant (docs/engine.md), so a
prefix's keys/values are the same bytes whichever sequence, batch or chunk computed them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from mxrl.engine.sequence import Sequence


def block_hashes(seq: Sequence, block_size: int, num_blocks: int) -> list[bytes]:
    """The hash of each of the sequence's first `num_blocks` full blocks, each covering every
    token up to the block's end (tokens are only ever appended, so the hashes are kept on the
    sequence and extended)."""
    hashes = seq.block_hashes
    while len(hashes) < num_blocks:
        b = len(hashes)
        chunk = np.asarray(seq.tokens[b * block_size : (b + 1) * block_size], dtype=np.int64)
        prev = hashes[-1] if hashes else b""
        hashes.append(hashlib.blake2b(prev + chunk.tobytes(), digest_size=16).digest())
    return hashes[:num_blocks]


class BlockManager:
    """`num_blocks` blocks of `block_size` tokens; see the module docstring."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # free blocks, oldest freed first; an ordered dict, not a deque: a cached block taken
        # back (`admit`) leaves from the middle, in O(1) (a deque's remove scans every free
        # block: 4 ms per block at the ~500k blocks of a GPU cache)
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # the routed experts of a registered block's tokens, [block_size, layers, k]: a sequence
        # that takes the block from the cache records them as its own (routing replay)
        self.routing: dict[int, torch.Tensor] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix sharing -----------------------------------------------------------------------

    def prompt_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the sequence's full blocks that may come from the cache: never the block
        of its last token, whose logits the step must compute."""
        return block_hashes(seq, self.block_size, (len(seq) - 1) // self.block_size)

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (block ids, in order)."""
        found = []
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def forget_prefixes(self) -> None:
        """No block is registered any more (a cached prefix is never handed out again); the
        free list keeps its order. Between `generate` calls (no sequence holds a block): a
        block still held then was lost by a call that failed, and is freed. In O(blocks) list
        writes: rebuilding the manager of a GPU cache (~500k blocks) took 75-100 ms. The
        forgotten blocks' routing entries stay until `allocate` hands their blocks out again
        (nothing reads a block's routing but through its registration): freeing them here, one
        small host tensor each, put ~1 us a block inside every weight update (~27k blocks after
        a 32 x 8 rollout of ~1,700-token sequences: about the update's own time)."""
        self.block_hash = [None] * self.num_blocks
        self.hash_to_block.clear()
        if self.num_free != self.num_blocks:  # between calls every block is free: else lost
            self.ref_count = [0] * self.num_blocks
            self.free = OrderedDict.fromkeys(range(self.num_blocks))

    # --- allocation ---------------------------------------------------------------------------

    def can_admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        """Enough free blocks to hold the sequence's first `num_tokens` tokens, `cached` shared."""
        reclaimed = sum(1 for b in cached if self.ref_count[b] == 0)  # taken out of `free`
        return self.blocks_for(num_tokens) - len(cached) <= self.num_free - reclaimed

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give `seq` the cached prefix blocks (their tokens count as computed)."""
        assert not seq.block_table, "admit a sequence once, or after preempt()"
        for b in cached:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
            seq.block_table.append(b)
        seq.num_computed = len(cached) * self.block_size
        seq.num_registered = len(cached)

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for the sequence's first `num_tokens` tokens; False (nothing taken) if the
        free blocks do not suffice."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            return False
        for _ in range(need):
            b, _ = self.free.popitem(last=False)
            old = self.block_hash[b]
            if old is not None and self.hash_to_block.get(old) == b:
                del self.hash_to_block[old]
            self.block_hash[b] = None
            self.routing.pop(b, None)
            self.ref_count[b] = 1
            seq.block_table.append(b)
        return True

    def release(self, seq: Sequence) -> None:
        """Return the sequence's blocks (shared ones stay with their other holders)."""
        for b in seq.block_table:
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0
            if self.ref_count[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.num_registered = 0

    def register(self, seq: Sequence, routing: Callable[[int], torch.Tensor]) -> None:
        """After a step: hash the sequence's newly completed full blocks so others can share
        them (a block already registered under its hash keeps that registration), with the
        routing of their tokens (`routing(p)`: the sequence's from position p on, [positions,
        layers, k])."""
        full = seq.num_computed // self.block_size
        if full <= seq.num_registered:  # the common decode step: nothing newly full
            return
        todo = [
            i
            for i in range(seq.num_registered, full)
            if self.block_hash[seq.block_table[i]] is None
        ]
        seq.num_registered = full
        if not todo:
            return
        hashes = block_hashes(seq, self.block_size, full)
        first = todo[0] * self.block_size
        routed = routing(first)
        for i in todo:
            b, h = seq.block_table[i], hashes[i]
            self.block_hash[b] = h
            self.hash_to_block.setdefault(h, b)
            start = i * self.block_size - first
            self.routing[b] = routed[start : start + self.block_size]
