"""Edge cases of mxrl/engine/scheduler.py from its mutation run (docs/mutation/engine.scheduler.md),
on the scheduler alone (a BlockManager, no model): which sequences each step takes and with
how many tokens (the token budget, chunked prefill, the sequence limit, arrival order), a
prompt whose blocks an earlier sequence is computing (deferred one step, then shared), a
sequence the free blocks cannot take (it keeps its place and nothing behind it jumps the
queue), preemption (the most recently admitted sequence not yet scheduled in the step, or the
sequence itself), the step queued ahead (`schedule_ahead`: when it is known, which blocks it
opens), and the bookkeeping of `finish`, `add` and the constructor. Every expected step is
worked out by hand from the module docstring's rules, block ids included (a BlockManager hands
out its free blocks oldest freed first, 0, 1, 2, ... at the start)."""

from __future__ import annotations

import pytest
import torch

from mxrl.engine import SamplingParams
from mxrl.engine.block_manager import BlockManager
from mxrl.engine.scheduler import Scheduled, Scheduler
from mxrl.engine.sequence import Sequence, Status


def _seq(index: int, prompt, max_new: int = 8) -> Sequence:
    return Sequence(index, list(prompt), SamplingParams(max_new_tokens=max_new), 0)


def _rows(batch: list[Scheduled]) -> list[tuple[int, int, int]]:
    """A step as (request index, start, tokens) per row, in order."""
    return [(s.seq.index, s.start, s.num_tokens) for s in batch]


def _advance(sched: Scheduler, batch: list[Scheduled], token: int = 99) -> None:
    """What the engine does after a step (Engine._advance): the fed tokens are computed, full
    blocks registered for sharing, every sampling row appends `token`, and a request that
    reached max_new_tokens finishes."""
    for s in batch:
        s.seq.num_computed += s.num_tokens
        sched.blocks.register(s.seq, lambda p: torch.zeros((64, 1, 1), dtype=torch.int64))
    for s in batch:
        if s.sample:
            s.seq.tokens.append(token)
            if s.seq.num_generated >= s.seq.params.max_new_tokens:
                sched.finish(s.seq, "length")


def _sched(num_blocks=16, block_size=4, max_num_seqs=8, budget=64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget)


# --- the constructor, add, finished, finish -------------------------------------------------


def test_limits_of_one_are_the_smallest_allowed():
    """max_num_seqs and max_num_batched_tokens of 1 are allowed, 0 of either is refused; a new
    scheduler holds nothing, has preempted nothing and is finished."""
    bm = BlockManager(4, 2)
    sched = Scheduler(bm, 1, 1)
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (1, 1)
    assert sched.blocks is bm and sched.num_preempted == 0
    assert list(sched.waiting) == [] and sched.running == [] and sched.finished
    for seqs, tokens in ((0, 1), (1, 0), (0, 0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            Scheduler(bm, seqs, tokens)


def test_add_takes_a_request_that_fills_the_cache_exactly():
    """The cache holds num_blocks * block_size = 3 * 4 = 12 tokens; a request needs its
    prompt + max_new_tokens - 1 (the last sampled token is never fed): 5 + 8 - 1 = 12 fits,
    5 + 9 - 1 = 13 is refused. add queues in arrival order, and a scheduler with a waiting
    request is not finished."""
    sched = _sched(num_blocks=3, block_size=4)
    a, b = _seq(0, range(5), max_new=8), _seq(1, range(1), max_new=1)
    sched.add(a)
    assert not sched.finished
    sched.add(b)
    assert list(sched.waiting) == [a, b]
    with pytest.raises(ValueError, match=r"needs up to 13 tokens.*holds 12"):
        sched.add(_seq(2, range(5), max_new=9))
    assert list(sched.waiting) == [a, b]


def test_finish_frees_the_blocks_and_records_the_reason():
    """A finished request gives its blocks back at once and leaves the running list with its
    reason; the scheduler is finished when nothing runs or waits."""
    sched = _sched(num_blocks=4, block_size=2)
    a, b = _seq(0, [1, 2, 3], max_new=2), _seq(1, [4, 5], max_new=2)
    sched.add(a)
    sched.add(b)
    assert _rows(sched.schedule()) == [(0, 0, 3), (1, 0, 2)]
    assert a.block_table == [0, 1] and b.block_table == [2] and sched.blocks.num_free == 1
    sched.finish(a, "stop")
    assert (a.status, a.finish_reason, a.block_table) == (Status.FINISHED, "stop", [])
    assert sched.running == [b] and sched.blocks.num_free == 3 and not sched.finished
    sched.finish(b, "length")
    assert (b.status, b.finish_reason) == (Status.FINISHED, "length")
    assert sched.running == [] and sched.finished and sched.blocks.num_free == 4


# --- admission: order, budget, chunks, the sequence limit ------------------------------------


def test_steps_take_running_then_waiting_within_the_token_budget():
    """Budget 10 tokens a step. Step 1: A (6 tokens) whole, B (3) whole, C gets the 1 token
    left (a chunk), D waits. Step 2: A and B decode one token each, C takes 4 of its
    remaining 4, D its first 4 of 7 (10 - 1 - 1 - 4 = 4). Step 3: A, B and C decode, D gets
    its last 3, and the 4 tokens left go unused (nothing waits)."""
    sched = _sched(budget=10)
    a, b, c, d = (_seq(i, [10 * i + j for j in range(n)]) for i, n in enumerate((6, 3, 5, 7)))
    for s in (a, b, c, d):
        sched.add(s)
    step = sched.schedule()
    assert _rows(step) == [(0, 0, 6), (1, 0, 3), (2, 0, 1)]
    assert [s.sample for s in step] == [True, True, False]  # C's chunk stops short of its end
    assert [s.ahead for s in step] == [False] * 3
    assert sched.running == [a, b, c] and list(sched.waiting) == [d]
    assert [s.status for s in (a, b, c, d)] == [Status.RUNNING] * 3 + [Status.WAITING]
    # blocks of 4 tokens: A 2 (0, 1), B 1 (2), C 1 for its one token (3)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2], [3])
    _advance(sched, step)
    step = sched.schedule()
    assert _rows(step) == [(0, 6, 1), (1, 3, 1), (2, 1, 4), (3, 0, 4)]
    assert [s.sample for s in step] == [True, True, True, False]
    assert (a.block_table, b.block_table, c.block_table, d.block_table) == (
        [0, 1],
        [2],
        [3, 4],  # C's 5 tokens: a second block
        [5],
    )
    _advance(sched, step)
    assert _rows(sched.schedule()) == [(0, 7, 1), (1, 4, 1), (2, 5, 1), (3, 4, 3)]


def test_a_spent_budget_schedules_no_later_running_sequence():
    """A step takes running sequences in order while its budget lasts: with 3 decoding and a
    budget lowered to 2 (the limit is read each step), the third gets no row at all (not a row
    of 0 tokens), and nothing is admitted."""
    sched = _sched(budget=8)
    seqs = [_seq(i, [i + 1]) for i in range(4)]
    for s in seqs[:3]:
        sched.add(s)
    _advance(sched, sched.schedule())
    sched.add(seqs[3])
    sched.max_num_batched_tokens = 2
    assert _rows(sched.schedule()) == [(0, 1, 1), (1, 1, 1)]
    assert list(sched.waiting) == [seqs[3]] and sched.running == seqs[:3]


def test_the_budget_left_by_running_sequences_goes_to_waiting_ones():
    """Budget 3: A takes 3 of its 5 prompt tokens; the next step gives A its last 2 and the one
    token left to B (a 1-token chunk that does not sample)."""
    sched = _sched(budget=3)
    a, b = _seq(0, [1, 2, 3, 4, 5]), _seq(1, [6, 7, 8])
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert _rows(step) == [(0, 0, 3)] and list(sched.waiting) == [b]
    _advance(sched, step)
    step = sched.schedule()
    assert _rows(step) == [(0, 3, 2), (1, 0, 1)]
    assert [s.sample for s in step] == [True, False]


def test_no_more_sequences_run_than_max_num_seqs():
    """max_num_seqs 2: of three one-token prompts two are admitted; the third joins when one
    finishes (max_new_tokens 1 ends A with the first step's token)."""
    sched = _sched(max_num_seqs=2)
    a, b, c = _seq(0, [1], max_new=1), _seq(1, [2]), _seq(2, [3])
    for s in (a, b, c):
        sched.add(s)
    step = sched.schedule()
    assert _rows(step) == [(0, 0, 1), (1, 0, 1)] and list(sched.waiting) == [c]
    _advance(sched, step)
    assert a.status is Status.FINISHED
    assert _rows(sched.schedule()) == [(1, 1, 1), (2, 0, 1)]


def test_a_sequence_the_free_blocks_cannot_take_keeps_its_place():
    """4 blocks of 2 tokens. A (3 tokens) takes 2. B (5 tokens: 3 blocks) does not fit the 2
    left: it stays at the front of the queue and C (1 token, 1 block), behind it, is not
    admitted either. When A finishes, B and C need exactly the 4 free blocks: both run."""
    sched = _sched(num_blocks=4, block_size=2)
    a, b, c = _seq(0, [1, 2, 3], max_new=1), _seq(1, [4, 5, 6, 7, 8], max_new=1), _seq(2, [9])
    for s in (a, b, c):
        sched.add(s)
    step = sched.schedule()
    assert _rows(step) == [(0, 0, 3)]
    assert list(sched.waiting) == [b, c] and b.status is Status.WAITING and b.block_table == []
    _advance(sched, step)  # A finishes: its blocks 0, 1 are freed after 2, 3
    assert _rows(sched.schedule()) == [(1, 0, 5), (2, 0, 1)]
    assert (b.block_table, c.block_table) == ([2, 3, 0], [1]) and sched.blocks.num_free == 0


# --- prefix sharing ---------------------------------------------------------------------------


def test_a_prompt_being_computed_is_shared_the_next_step_in_arrival_order():
    """Blocks of 2. S0, S1, S2 share a 5-token prompt (its first two blocks may be shared: the
    block of the last token never is); T is another prompt. Step 1 admits S0 and T and defers
    S1 and S2 (S0 is computing their blocks). Step 2 gives S1 then S2 (arrival order) S0's two
    blocks from the cache and one new block each for the last token."""
    sched = _sched(block_size=2)
    prompt = [1, 2, 3, 4, 5]
    s0, s1, t, s2 = _seq(0, prompt), _seq(1, prompt), _seq(2, [9, 9, 9]), _seq(3, prompt)
    for s in (s0, s1, t, s2):
        sched.add(s)
    step = sched.schedule()
    assert _rows(step) == [(0, 0, 5), (2, 0, 3)]
    assert list(sched.waiting) == [s1, s2] and s0.block_table == [0, 1, 2]
    assert t.block_table == [3, 4]
    _advance(sched, step)
    step = sched.schedule()
    assert _rows(step) == [(0, 5, 1), (2, 3, 1), (1, 4, 1), (3, 4, 1)]
    assert s1.block_table == [0, 1, 5] and s2.block_table == [0, 1, 6]
    assert (s1.num_computed, s2.num_computed) == (4, 4)


def test_a_prompt_still_prefilling_in_chunks_defers_its_copies():
    """Budget 4, blocks of 2, a 7-token prompt (shareable blocks: 3). Step 1: S0 takes 4
    tokens (blocks 0 and 1 registered after it). Step 2: S0 takes its last 3; block 2 is
    S0's to compute, so S1 (which finds blocks 0 and 1 cached) waits rather than computing
    it too, though a token of budget is left. Step 3: S1 takes all three blocks from the
    cache and computes only its last token. A prompt sharing only S0's computed blocks (Q)
    is admitted at once."""
    sched = _sched(block_size=2, budget=4)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    s0, s1 = _seq(0, prompt), _seq(1, prompt)
    sched.add(s0)
    sched.add(s1)
    step = sched.schedule()
    assert _rows(step) == [(0, 0, 4)] and list(sched.waiting) == [s1]
    _advance(sched, step)
    step = sched.schedule()
    assert _rows(step) == [(0, 4, 3)] and list(sched.waiting) == [s1]
    assert s1.status is Status.WAITING and s1.block_table == []
    _advance(sched, step)
    step = sched.schedule()
    assert _rows(step) == [(0, 7, 1), (1, 6, 1)]
    assert s1.block_table == [0, 1, 2, 4] and s0.block_table == [0, 1, 2, 3]

    sched = _sched(block_size=2, budget=5)
    s0, q = _seq(0, prompt), _seq(1, [1, 2, 3, 4, 8, 8, 8])
    sched.add(s0)
    _advance(sched, sched.schedule())  # S0 computed 5 of 7: blocks 0, 1 registered
    sched.add(q)
    step = sched.schedule()  # S0's last 2; Q's block 2 differs from S0's: not deferred
    assert _rows(step) == [(0, 5, 2), (1, 4, 3)]
    assert q.block_table == [0, 1, 4, 5]  # S0 took block 3 first


def test_a_decoding_sequence_defers_nothing():
    """A running sequence that has computed its whole prompt computes no prompt block any
    more: a later request with the same prompt takes its blocks from the cache at once, in
    the step after the prompt was computed (not one more step later)."""
    sched = _sched(block_size=2)
    prompt = [3, 1, 4, 1, 5]
    s0 = _seq(0, prompt)
    sched.add(s0)
    _advance(sched, sched.schedule())
    s1 = _seq(1, prompt)
    sched.add(s1)
    assert _rows(sched.schedule()) == [(0, 5, 1), (1, 4, 1)]
    assert s1.block_table == [0, 1, 3]


# --- preemption --------------------------------------------------------------------------------


def test_preemption_takes_the_last_admitted_unscheduled_sequence_then_the_sequence_itself():
    """3 blocks of 2 tokens; A, B, C (2-token prompts) take one each and sample. Step 2: A
    needs a second block and none is free: C (the most recently admitted, not yet in the step)
    is preempted and its block goes to A. B then needs a block too: the only other running
    sequence (A) is in the step already, so B preempts itself. Both go back to the front of
    the queue, B first (preempted last), with nothing computed; B's old block is still cached
    under its prompt, but taking it back and a block for its sampled token needs 2 blocks
    where 1 is free: B is not admitted and the step is A's alone."""
    sched = _sched(num_blocks=3, block_size=2)
    a, b, c = _seq(0, [1, 2], max_new=4), _seq(1, [3, 4], max_new=4), _seq(2, [5, 6], max_new=4)
    for s in (a, b, c):
        sched.add(s)
    step = sched.schedule()
    assert _rows(step) == [(0, 0, 2), (1, 0, 2), (2, 0, 2)]
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])
    _advance(sched, step)
    step = sched.schedule()
    assert _rows(step) == [(0, 2, 1)]
    assert sched.num_preempted == 2
    assert sched.running == [a] and list(sched.waiting) == [b, c]
    for s in (b, c):
        assert (s.status, s.num_computed, s.block_table) == (Status.WAITING, 0, [])
    assert a.block_table == [0, 2] and sched.blocks.num_free == 1
    assert len(b.tokens) == 3  # its sampled token is kept: recomputed later, not resampled
    _advance(sched, step)
    assert _rows(sched.schedule()) == [(0, 3, 1)] and list(sched.waiting) == [b, c]


def test_a_preempted_sequence_is_recomputed_from_its_first_token():
    """2 blocks of 2. A (2 tokens) and B (1 token) take a block each. Step 2: A (3 tokens
    now) needs a second block: B is preempted. Step 3 re-admits nothing while A holds both
    blocks; when A finishes, B comes back computing its prompt and sampled token again (2
    tokens from position 0), without being preempted a second time."""
    sched = _sched(num_blocks=2, block_size=2)
    a, b = _seq(0, [1, 2], max_new=2), _seq(1, [7], max_new=3)
    sched.add(a)
    sched.add(b)
    _advance(sched, sched.schedule())
    step = sched.schedule()
    assert _rows(step) == [(0, 2, 1)] and sched.num_preempted == 1
    assert list(sched.waiting) == [b] and a.block_table == [0, 1]
    _advance(sched, step)  # A's second token: it finishes
    assert a.status is Status.FINISHED
    assert _rows(sched.schedule()) == [(1, 0, 2)] and sched.num_preempted == 1


# --- the step queued ahead --------------------------------------------------------------------


def _decoding(sched: Scheduler, prompts, max_new=8):
    """Requests admitted, prefilled and sampled once: the next step is their decode step."""
    seqs = [_seq(i, p, max_new) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    _advance(sched, sched.schedule())
    return seqs, sched.schedule()


def test_schedule_ahead_feeds_each_running_request_its_next_position():
    """Blocks of 4. A (3 tokens) and B (5) decode at positions 3 and 5; the step after feeds
    positions 4 and 6, ahead. A's position 4 opens its second block (the next free, 3), B's
    position 6 is inside its second block."""
    sched = _sched(block_size=4)
    (a, b), step = _decoding(sched, [[1, 2, 3], [4, 5, 6, 7, 8]])
    assert _rows(step) == [(0, 3, 1), (1, 5, 1)]
    assert (a.block_table, b.block_table) == ([0], [1, 2])
    ahead = sched.schedule_ahead(step)
    assert _rows(ahead) == [(0, 4, 1), (1, 6, 1)]
    assert [s.ahead and s.sample for s in ahead] == [True, True]
    assert ahead[0].seq is a and ahead[1].seq is b
    assert (a.block_table, b.block_table) == ([0, 3], [1, 2])
    assert not Scheduled(a, 4, 1).sample  # position 4 is not the end of A's tokens yet


def test_schedule_ahead_takes_blocks_only_when_all_fit():
    """Blocks of 2, 5 of them. A (1 token) and B (3) decode at positions 1 and 3: both next
    positions (2, 4) open a block. With 2 free blocks (exactly enough) they are taken; with 1
    the answer is None and no block is taken."""
    sched = _sched(num_blocks=5, block_size=2)
    (a, b), step = _decoding(sched, [[1], [2, 3, 4]], max_new=4)
    assert (a.block_table, b.block_table) == ([0], [1, 2]) and sched.blocks.num_free == 2
    assert _rows(sched.schedule_ahead(step)) == [(0, 2, 1), (1, 4, 1)]
    assert (a.block_table, b.block_table) == ([0, 3], [1, 2, 4])

    sched = _sched(num_blocks=4, block_size=2)
    (a, b), step = _decoding(sched, [[1], [2, 3, 4]], max_new=4)
    assert sched.blocks.num_free == 1
    assert sched.schedule_ahead(step) is None
    assert (a.block_table, b.block_table) == ([0], [1, 2]) and sched.blocks.num_free == 1


def test_schedule_ahead_is_none_unless_the_step_is_known():
    """None while a request waits, with nothing running, when a running request is not in the
    step (or not in its order), when a row is not a one-token decode, or when the step's token
    can end a request by length (max_new_tokens 3: its second token is sampled in the step in
    flight, so the step after may not exist)."""
    sched = _sched(block_size=4)
    (a, b), step = _decoding(sched, [[1, 2], [3, 4]])
    assert sched.schedule_ahead(step) is not None
    assert sched.schedule_ahead([step[0]]) is None  # B not in it
    assert sched.schedule_ahead(step[::-1]) is None  # not in running order
    assert sched.schedule_ahead([step[0], Scheduled(b, 1, 2)]) is None  # two tokens
    assert sched.schedule_ahead([step[0], Scheduled(b, 0, 1)]) is None  # does not sample
    assert sched.schedule_ahead([]) is None

    sched = _sched(block_size=4)
    (a,), _ = _decoding(sched, [[1, 2]])
    sched.add(_seq(5, [7]))
    assert sched.schedule_ahead([Scheduled(a, 2, 1)]) is None  # a request waits
    assert _sched().schedule_ahead([]) is None  # nothing runs

    for max_new, known in ((2, False), (3, False), (4, True)):
        sched = _sched(block_size=4)
        (a,), step = _decoding(sched, [[1, 2]], max_new=max_new)
        if max_new == 2:  # generated 1 of 2: the step in flight ends it
            assert sched.schedule_ahead(step) is None
            continue
        _advance(sched, step)  # generated 2
        step = sched.schedule()
        assert (sched.schedule_ahead(step) is not None) == known, max_new


def test_schedule_ahead_leaves_out_rows_of_finished_requests():
    """A row whose request finished (an ahead step's row after a stop) gets no row in the step
    after; the others keep their order."""
    sched = _sched(block_size=4)
    (_, b, _), step = _decoding(sched, [[1], [2], [3]])
    sched.finish(b, "stop")
    assert _rows(sched.schedule_ahead(step)) == [(0, 2, 1), (2, 2, 1)]


def test_schedule_ahead_opens_one_block_for_one_position():
    """Blocks of 1 token: every position opens a block. A (2 tokens) decodes at position 2
    (its third block, 2); the step after feeds position 3 and takes exactly one more block
    (3) for it, not one for a position beyond."""
    sched = _sched(block_size=1)
    (a,), step = _decoding(sched, [[1, 2]], max_new=4)
    assert _rows(step) == [(0, 2, 1)] and a.block_table == [0, 1, 2]
    assert _rows(sched.schedule_ahead(step)) == [(0, 3, 1)]
    assert a.block_table == [0, 1, 2, 3] and sched.blocks.num_free == 12


def test_a_sequence_past_its_prompt_defers_nobody():
    """Only prompt blocks being computed defer a waiting request. A was preempted after 3
    tokens (they are kept, nothing is computed) and recomputes 4 tokens a step behind X's
    decode row (budget 5, blocks of 2): after step 1 it has computed exactly its 4-token
    prompt, blocks 1 and 2 registered. In step 2 it computes its 3 generated tokens; B, whose
    prompt is A's prompt and two of those tokens, finds A's first two blocks cached and takes
    the token of budget left at once instead of waiting for A's third block."""
    sched = _sched(block_size=2, budget=5)
    x = _seq(0, [7])
    a = Sequence(1, [1, 2, 3, 4], SamplingParams(max_new_tokens=8), 0, tokens=[1, 2, 3, 4, 9, 9, 9])
    sched.add(x)
    sched.add(a)
    step = sched.schedule()
    assert _rows(step) == [(0, 0, 1), (1, 0, 4)]
    _advance(sched, step)
    b = _seq(2, [1, 2, 3, 4, 9, 9, 5])
    sched.add(b)
    assert _rows(sched.schedule()) == [(0, 1, 1), (1, 4, 3), (2, 4, 1)]
    assert b.block_table == [1, 2, 5]
