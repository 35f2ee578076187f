"""Continuous batching: which sequences run in the next step, with how many tokens.

Each step takes, in order: every running sequence (one token when decoding; the next chunk of
its prompt when still prefilling), then waiting sequences in arrival order while the step's
token budget (`max_num_batched_tokens`), the sequence limit (`max_num_seqs`) and the free KV
blocks allow. A prompt longer than the budget is prefilled in chunks over several steps. A
finished sequence frees its blocks at once, so waiting ones join between steps.

Prefix sharing: a waiting sequence whose prompt blocks are being computed by a sequence admitted
earlier (the n samples of one GRPO prompt) waits one step more and then takes those blocks from
the cache, instead of computing the same prompt n times.

When a running sequence needs a block and none is free, the most recently admitted sequence
not yet scheduled in this step is preempted: its blocks are freed and it goes back to the front
of the queue, to be recomputed later. Recomputation gives the same bytes (the forward is batch-
and chunk-invariant) and sampling noise is a hash of the sequence's seed and token count, so
preemption never changes an output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mxrl.engine.block_manager import BlockManager
from mxrl.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class Scheduled:
    """One sequence in a step: feed tokens[start:start + num_tokens]; `sample` when that
    reaches the end of its tokens (its last token's logits give the next token).

    ahead: a decode step launched before the step in flight has brought its token to the host
    (the engine's overlapped decoding, `Scheduler.schedule_ahead`): the one token it feeds, at `start`, is that step's
    sampled token, still on the device, and not yet in `seq.tokens`."""

    seq: Sequence
    start: int
    num_tokens: int
    ahead: bool = False

    @property
    def sample(self) -> bool:
        return self.ahead or self.start + self.num_tokens == len(self.seq)


class Scheduler:
    def __init__(
        self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preempted = 0

    @property
    def finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if seq.max_len > capacity:
            raise ValueError(
                f"request {seq.index} needs up to {seq.max_len} tokens of KV cache (prompt "
                f"{len(seq.prompt)} + max_new_tokens {seq.params.max_new_tokens} - 1); the engine "
                f"holds {capacity}. Give the engine more KV memory (CacheOptions.kv_cache_bytes) or "
                "shorten the request"
            )
        self.waiting.append(seq)

    def schedule(self) -> list[Scheduled]:
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            while not self.blocks.ensure(seq, seq.num_computed + n):
                victims = [s for s in self.running if s is not seq and not _in(out, s)]
                self._preempt(victims[-1] if victims else seq)
                if not victims:
                    break
            if seq.status is Status.RUNNING:
                out.append(Scheduled(seq, seq.num_computed, n))
                budget -= n
        inflight = {h for s in self.running for h in self._pending_hashes(s)}
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            hashes = self.blocks.prompt_hashes(seq)
            cached = self.blocks.cached_prefix(hashes)
            if len(cached) < len(hashes) and hashes[len(cached)] in inflight:
                deferred.append(seq)  # its prefix is being computed: share it next step
                continue
            start = len(cached) * self.blocks.block_size
            n = min(len(seq) - start, budget)
            if not self.blocks.can_admit(seq, cached, start + n):
                self.waiting.appendleft(seq)
                break
            self.blocks.admit(seq, cached)
            assert self.blocks.ensure(seq, start + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            inflight.update(hashes[len(cached) :])
            out.append(Scheduled(seq, start, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return out

    def schedule_ahead(self, batch: list[Scheduled]) -> list[Scheduled] | None:
        """The step after `batch` (a step still on the device), if it is known before that
        step's tokens are read: the running requests, in `batch`'s order, each feeding the
        token `batch` samples for it (`Scheduled.ahead`). Only when that is exactly what
        `schedule` would return: nothing waits to be admitted, every running request is in
        `batch` as a one-token decode row. A request that `batch` ends by length (its last
        token sampled there) gets no row, as `schedule` would give it none once it finished;
        nor do rows of `batch` whose request has finished already (`batch` is then an ahead
        step whose tokens came after a stop: its dropped rows). The engine feeds the rows
        their tokens from `batch` (`Launched.live_tokens`). A row whose next position opens a
        KV block gets it here, as `schedule` would (`BlockManager.ensure`), when the free
        blocks suffice for every such row; otherwise `schedule` would preempt, and the answer
        is None. None when the step is not known yet, or when no request is left in it."""
        if self.waiting or not self.running:
            return None
        live = [s for s in batch if s.seq.status is not Status.FINISHED]
        if len(live) != len(self.running):
            return None
        out, opening = [], []
        for s, seq in zip(live, self.running, strict=True):
            pos = s.start + 1
            if (
                s.seq is not seq
                or s.num_tokens != 1
                or not s.sample
                or seq.status is not Status.RUNNING
            ):
                return None
            if seq.num_generated + 1 >= seq.params.max_new_tokens:
                continue  # `batch` samples its last token: done before the step after
            if pos % self.blocks.block_size == 0 and self.blocks.blocks_for(pos + 1) > len(
                seq.block_table
            ):
                opening.append((seq, pos + 1))
            out.append(Scheduled(seq, pos, 1, ahead=True))
        if not out or len(opening) > self.blocks.num_free:
            return None
        for seq, num_tokens in opening:
            taken = self.blocks.ensure(seq, num_tokens)
            assert taken, "free blocks were counted before"
        return out

    def _pending_hashes(self, seq: Sequence) -> list[bytes]:
        """Prompt-block hashes a running sequence has not computed yet."""
        if seq.num_computed >= len(seq.prompt):
            return []
        hashes = self.blocks.prompt_hashes(seq)
        return hashes[seq.num_computed // self.blocks.block_size :]

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preempted += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.blocks.release(seq)
        self.running.remove(seq)


def _in(scheduled: list[Scheduled], seq: Sequence) -> bool:
    return any(s.seq is seq for s in scheduled)
