"""The paged KV cache and the scheduler: prefix sharing for GRPO groups, chunked prefill,
continuous batching, preemption and the memory bound -- none of which may change a byte of any
request's output (the engine's forward is batch- and chunk-invariant)."""

from __future__ import annotations

import pytest
import torch

from mxrl.engine import CacheOptions, Engine, SamplingParams
from mxrl.engine.block_manager import BlockManager
from mxrl.engine.runner import ModelRunner
from mxrl.engine.sequence import Sequence
from tests.engine.test_engine import PROMPTS, tiny
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability

LONG = [(7 * i + 3) % 60 + 1 for i in range(37)]  # 37 tokens: 2 full blocks of 16 + 5


def _params(n: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, max_new_tokens=6, seed=500 + i, **kw) for i in range(n)]


def _same(got, want, what=""):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.tokens == w.tokens, f"{what} request {i} tokens"
        assert_bytes_equal(g.logprobs, w.logprobs, f"{what} request {i} logprobs")
        assert_bytes_equal(g.routed_experts, w.routed_experts, f"{what} request {i} routing")
        assert g.finish_reason == w.finish_reason


def _alone(engine: Engine, prompts, params):
    return [engine.generate([p], [q])[0] for p, q in zip(prompts, params, strict=True)]


def _count_fed_tokens(monkeypatch) -> list[int]:
    fed: list[int] = []
    original = ModelRunner.step

    def step(self, batch, ahead=None):
        fed.append(sum(s.num_tokens for s in batch))
        return original(self, batch, ahead)

    monkeypatch.setattr(ModelRunner, "step", step)
    return fed


# --- the block manager --------------------------------------------------------------------------


def _seq(tokens, index=0):
    return Sequence(index, list(tokens), SamplingParams(), torch.Generator())


def test_blocks_are_counted_shared_and_reused_until_handed_out_again():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _seq(range(10))
    assert bm.prompt_hashes(a) == bm.prompt_hashes(_seq(range(10)))  # content, not identity
    assert len(bm.prompt_hashes(a)) == 2  # never the block of the last token
    bm.admit(a, [])
    assert bm.ensure(a, 10) and len(a.block_table) == 3 and bm.num_free == 1
    a.num_computed = 10
    bm.register(a, lambda p: torch.zeros((10 - p, 2, 2), dtype=torch.int64))
    b = _seq(range(10), index=1)
    cached = bm.cached_prefix(bm.prompt_hashes(b))
    assert cached == a.block_table[:2]
    assert bm.can_admit(b, cached, 10)  # 2 shared + 1 new block
    bm.admit(b, cached)
    assert b.num_computed == 8 and bm.ensure(b, 10) and bm.num_free == 0
    assert not bm.ensure(_seq(range(30), 2), 5)  # nothing left: refused, nothing taken
    bm.release(a)
    bm.release(b)
    assert bm.num_free == 4
    c = _seq(range(10), index=3)  # the prefix outlives its sequences while unclaimed
    assert bm.cached_prefix(bm.prompt_hashes(c)) == cached
    hog = _seq(range(100, 116), index=4)
    assert bm.ensure(hog, 16)  # takes every block, the cached ones too
    assert bm.cached_prefix(bm.prompt_hashes(c)) == []


def test_routing_from_a_position_joins_only_the_parts_it_needs():
    seq = _seq(range(3))
    rows = torch.arange(30 * 4).view(30, 2, 2)
    for a, b in [(0, 17), (17, 18), (18, 19), (19, 30)]:  # a prefill part, then decode rows
        seq.routing.append(rows[a:b])
        seq.num_routed = b
    for start in (0, 5, 17, 18, 19, 25, 29):
        assert torch.equal(seq.routing_from(start), rows[start:])
    with pytest.raises(ValueError, match="position 30"):
        seq.routing_from(30)


def test_the_parts_routing_from_joins_are_kept_as_one():
    """A block's decode rows, joined as the block fills, stay joined: the parts a completion
    joins are one a block, not one a token, and every position keeps its row."""
    seq = _seq(range(3))
    rows = torch.arange(40 * 4).view(40, 2, 2)
    seq.routing, seq.num_routed = [rows[:8]], 8  # the prompt
    for p in range(8, 40):  # decode rows, one part each; a block of 8 fills every 8th
        seq.routing.append(rows[p : p + 1])
        seq.num_routed = p + 1
        if (p + 1) % 8 == 0:
            assert torch.equal(seq.routing_from(p + 1 - 8), rows[p + 1 - 8 : p + 1])
    assert [part.shape[0] for part in seq.routing] == [8, 8, 8, 8, 8]
    assert torch.equal(torch.cat(seq.routing), rows)
    assert torch.equal(seq.routing_from(12), rows[12:])  # across parts: joined once more
    assert [part.shape[0] for part in seq.routing] == [8, 32]
    assert torch.equal(torch.cat(seq.routing), rows)
    assert torch.equal(seq.routing_from(39), rows[39:])  # inside one part: nothing to join
    assert [part.shape[0] for part in seq.routing] == [8, 32]


def test_a_cached_block_taken_back_leaves_the_free_order_of_the_rest_alone():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = _seq(range(9))  # 2 full prompt blocks + the last token's
    bm.admit(a, [])
    assert bm.ensure(a, 9)
    a.num_computed = 9
    bm.register(a, lambda p: torch.zeros((9 - p, 2, 2), dtype=torch.int64))
    bm.release(a)  # free, oldest first: 3 4 5 then a's 0 1 2
    b = _seq(range(9), index=1)
    cached = bm.cached_prefix(bm.prompt_hashes(b))
    assert cached == [0, 1]
    bm.admit(b, cached)  # 0 and 1 leave the free list from its middle
    assert bm.num_free == 4
    c = _seq(range(50, 66), index=2)
    assert bm.ensure(c, 16)
    assert c.block_table == [3, 4, 5, 2]  # the rest in the order they were freed


def test_taking_back_cached_blocks_does_not_scan_the_free_list():
    """A GPU cache has ~500k blocks; taking a cached block back cost a scan of the free list
    (4 ms a block: 3.7 s to admit 128 repeated 128-token prompts on the H200). 2000 blocks
    taken back from 400k free ones: about 1 ms in O(1), minutes as a scan."""
    import time

    bm = BlockManager(num_blocks=400_000, block_size=1)
    a = _seq(range(2001))
    bm.admit(a, [])
    assert bm.ensure(a, 2001)
    a.num_computed = 2001
    bm.register(a, lambda p: torch.zeros((2001 - p, 1, 1), dtype=torch.int64))
    bm.release(a)  # its blocks go to the end of the free list
    b = _seq(range(2001), index=1)
    cached = bm.cached_prefix(bm.prompt_hashes(b))
    assert len(cached) == 2000
    start = time.perf_counter()
    bm.admit(b, cached)
    assert time.perf_counter() - start < 0.5
    assert bm.num_free == 400_000 - 2000


# --- the engine ---------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["bf16", "nvfp4-dequantized"])
def test_grpo_groups_share_their_prompt_and_get_the_bytes_they_get_alone(preset, monkeypatch):
    engine = Engine(tiny(preset), preset, tile=8)
    prompts = [LONG] * 4 + [PROMPTS[0]] * 4
    params = _params(len(prompts))
    want = _alone(engine, prompts, params)
    fed = _count_fed_tokens(monkeypatch)
    engine.reset_prefix_cache()  # forget the prefixes the lone runs left in the cache
    got = engine.generate(prompts, params)
    _same(got, want, "grouped")
    # LONG's two full blocks (32 tokens) are computed once, not four times
    prefill = len(LONG) + 3 * (len(LONG) - 32) + 4 * len(PROMPTS[0])
    decode = sum(len(o.tokens) - 1 for o in got)
    assert sum(fed) == prefill + decode


def test_chunked_prefill_and_a_small_step_budget_change_nothing():
    engine = Engine(tiny("mxfp8"), "mxfp8", tile=8)
    prompts, params = [LONG, *PROMPTS], _params(len(PROMPTS) + 1)
    want = engine.generate(prompts, params)
    small = Engine(tiny("mxfp8"), "mxfp8", tile=8, cache=CacheOptions(max_num_batched_tokens=5))
    _same(small.generate(prompts, params), want, "5 tokens per step")
    few = Engine(tiny("mxfp8"), "mxfp8", tile=8, cache=CacheOptions(max_num_seqs=2))
    _same(few.generate(prompts, params), want, "2 sequences per step")


def test_a_cached_prefix_carries_the_routing_of_every_step_that_computed_it(monkeypatch):
    """A prompt computed over several steps (5-token chunks, then decode) registers its blocks
    as they fill, each with the routing of its own positions; a continuation of it takes those
    blocks from the cache and gets the same routed experts as on an engine that computed all."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    engine = Engine(tiny(), "bf16", tile=8, cache=CacheOptions(max_num_batched_tokens=5))
    first = engine.generate([LONG], greedy)[0]
    follow = LONG + first.tokens[:12]  # 49 tokens: 3 full blocks, the third filled by decode
    fresh = Engine(tiny(), "bf16", tile=8)
    want = fresh.generate([follow], greedy)
    fed = _count_fed_tokens(monkeypatch)
    got = engine.generate([follow], greedy)
    assert fed[0] == 1  # 48 of its 49 prompt tokens came from the cache
    _same(got, want, "from the cache")
    engine.reset_prefix_cache()
    fed.clear()
    _same(engine.generate([follow], greedy), want, "after a reset")
    assert fed[:10] == [5] * 9 + [4]  # all 49 computed again, 5 a step


def test_preemption_recomputes_the_same_bytes(monkeypatch):
    """Four 15-token prompts fit one block each; decoding, each needs a second block, and a
    5-block cache has one to spare: sequences are preempted and recomputed."""
    from mxrl.engine.scheduler import Scheduler

    model = tiny("nvfp4-hp")
    prompts = [[(i * 11 + j) % 60 + 1 for j in range(15)] for i in range(4)]
    params = _params(len(prompts))
    want = Engine(model, "nvfp4-hp", tile=8).generate(prompts, params)
    preempted = []
    original = Scheduler._preempt
    monkeypatch.setattr(
        Scheduler, "_preempt", lambda self, seq: (preempted.append(seq.index), original(self, seq))
    )
    per_block = 2 * 4 * 16 * 2 * 16 * 4  # k+v, 4 layers, 16 tokens, 2 kv heads, dim 16, fp32
    tight = Engine(model, "nvfp4-hp", tile=8, cache=CacheOptions(kv_cache_bytes=5 * per_block))
    _same(tight.generate(prompts, params), want, "preempted")
    assert preempted, "the cache was meant to be too small for all four at once"


def test_a_request_larger_than_the_cache_is_refused_before_any_work(monkeypatch):
    per_block = 2 * 4 * 16 * 2 * 16 * 4
    engine = Engine(tiny(), "bf16", tile=8, cache=CacheOptions(kv_cache_bytes=2 * per_block))
    fed = _count_fed_tokens(monkeypatch)
    with pytest.raises(ValueError, match=r"request 1 needs up to 42 tokens.*holds 32"):
        engine.generate([PROMPTS[1], LONG], _params(2))
    assert fed == []
    with pytest.raises(ValueError, match="holds no block"):
        Engine(tiny(), "bf16", cache=CacheOptions(kv_cache_bytes=100)).generate(
            [PROMPTS[0]], _params(1)
        )
    with pytest.raises(ValueError, match="max_num_seqs"):
        CacheOptions(max_num_seqs=0)


def test_next_token_logits_are_the_first_samples_logits():
    engine = Engine(tiny(), "bf16", tile=8)
    logits = engine.next_token_logits([LONG, PROMPTS[1]])
    assert logits.shape == (2, engine.config.vocab_size) and logits.dtype == torch.float32
    greedy = engine.generate([LONG, PROMPTS[1]], SamplingParams(temperature=0, max_new_tokens=1))
    assert [o.tokens[0] for o in greedy] == logits.argmax(-1).tolist()


def test_a_failed_generate_gives_its_blocks_back(monkeypatch):
    """An error inside generate (here the third step's forward) leaves no KV block held: the
    engine's next call has the whole cache and gives a fresh engine's bytes."""
    engine = Engine(tiny(), "bf16", tile=8)
    prompts, params = [LONG, *PROMPTS], _params(len(PROMPTS) + 1)
    calls = []
    original = ModelRunner.step

    def failing(self, batch, ahead=None):
        calls.append(len(batch))
        if len(calls) == 3:
            raise RuntimeError("injected")
        return original(self, batch, ahead)

    monkeypatch.setattr(ModelRunner, "step", failing)
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate(prompts, params)
    assert engine._blocks.num_free == engine._blocks.num_blocks
    monkeypatch.setattr(ModelRunner, "step", original)
    _same(
        engine.generate(prompts, params), Engine(tiny(), "bf16", tile=8).generate(prompts, params)
    )


def test_cached_blocks_after_a_part_recorded_block_add_only_the_positions_not_recorded():
    """A sequence whose routing is recorded up to the middle of a block, then given cached
    blocks up to a later position, records each position once (the cached block it was in the
    middle of contributes its later positions only)."""
    engine = Engine(tiny(), "bf16", tile=8, cache=CacheOptions(block_size=4))
    _, blocks = engine._cache()
    rows = torch.arange(16 * 2 * 2).view(16, 2, 2)
    seq = _seq(range(16))
    seq.block_table = [0, 1, 2, 3]
    for b in range(4):
        blocks.routing[b] = rows[4 * b : 4 * b + 4]
    seq.routing, seq.num_routed = [rows[:10]], 10  # recorded up to the middle of block 2
    seq.record_routing(12, rows[12:14], blocks)  # positions 10, 11 come from block 2
    assert seq.num_routed == 14
    assert torch.equal(torch.cat(seq.routing), rows[:14])
    assert torch.equal(seq.routing_from(9), rows[9:14])
