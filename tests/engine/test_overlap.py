"""Overlapped decoding (`Engine(overlap=True)`, the default on CUDA): the next decode step is
queued before the step before it is read back, feeding that step's sampled tokens on the
device. It must change no byte of any output: tokens, logprobs, routing and finish reasons
equal those of the same engine decoding one step at a time, through stops that leave a dropped
row in the step queued ahead, lengths that end requests, KV block boundaries, requests joining
mid-run, shared GRPO prompts and preemption. On the CPU the steps are computed when launched,
so this checks the bookkeeping, not the speed (docs/engine.md)."""

from __future__ import annotations

import pytest

from mxrl.engine import CacheOptions, Engine, SamplingParams
from mxrl.engine.scheduler import Scheduler
from tests.engine.test_engine import PROMPTS, tiny
from tests.engine.test_scheduler import LONG, _same


def _both(make, prompts, params):
    """(outputs one step at a time, outputs overlapped, the overlapped engine's stats)."""
    want = make(overlap=False).generate(prompts, params)
    engine = make(overlap=True)
    got = engine.generate(prompts, params)
    return want, got, engine.stats


def _params(lengths, stop=(), temperature=1.0):
    return [
        SamplingParams(temperature=temperature, max_new_tokens=n, seed=40 + i, stop_token_ids=stop)
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("preset", ["bf16", "nvfp4-dequantized"])
def test_overlapped_decoding_gives_the_bytes_of_one_step_at_a_time(preset):
    def make(overlap):  # 4-token blocks: a block boundary every 4 steps
        return Engine(
            tiny(preset), preset, tile=8, cache=CacheOptions(block_size=4), overlap=overlap
        )

    prompts = [PROMPTS[0], PROMPTS[1], LONG]
    lengths = [7, 23, 18]
    want, got, stats = _both(make, prompts, _params(lengths))
    _same(got, want, "overlapped")
    assert [len(o.tokens) for o in got] == lengths
    assert stats.ahead_steps > 0 and stats.ahead_rows_dropped == 0


def test_every_decode_step_but_the_first_is_queued_ahead_across_block_boundaries():
    """One request, 4-token blocks: a step whose next position opens a block takes it early,
    so every decode step after the first is queued ahead except after the one that ends it."""
    prompt, new = PROMPTS[0], 23
    engine = Engine(tiny("bf16"), "bf16", tile=8, cache=CacheOptions(block_size=4), overlap=True)
    out = engine.generate([prompt], _params([new]))[0]
    assert len(out.tokens) == new
    decode_steps = new - 1  # the prefill samples the first token
    assert engine.stats.ahead_steps == decode_steps - 1


def test_requests_ending_by_length_do_not_stop_the_step_after_from_being_queued_ahead():
    """Requests of different lengths (an RL rollout's, each its own max_new_tokens): a step
    that samples one request's last token still has the step after it queued ahead, without a
    row for that request; every decode step but the first is queued ahead, and the bytes are
    those of one step at a time."""

    def make(overlap):
        return Engine(
            tiny("bf16"), "bf16", tile=8, cache=CacheOptions(block_size=4), overlap=overlap
        )

    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], LONG]
    lengths = [5, 17, 9, 12]
    want, got, stats = _both(make, prompts, _params(lengths))
    _same(got, want, "ending by length")
    assert [len(o.tokens) for o in got] == lengths
    assert [o.finish_reason for o in got] == ["length"] * 4
    assert stats.ahead_rows_dropped == 0  # nothing is queued for a request that ended
    assert stats.ahead_steps == len(stats.decode_step_s) - 1
    assert stats.decode_step_rows[-1] == 1  # the longest request decodes alone at the end


def test_a_stop_leaves_a_dropped_row_in_the_step_queued_ahead():
    def make(overlap):
        return Engine(tiny("bf16"), "bf16", tile=8, overlap=overlap)

    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    free = make(False).generate(prompts, _params([30, 30, 30]))[0].tokens
    # a token request 0 first samples in a decode step past the second (whatever this CPU's
    # numerics make the tokens): stopped there, it leaves a row in the step queued ahead
    stop = free[next(k for k in range(2, len(free)) if free[k] not in free[:k])]
    want, got, stats = _both(make, prompts, _params([30, 30, 30], stop=(stop,)))
    _same(got, want, "with a stop")
    assert got[0].finish_reason == "stop" and len(got[0].tokens) < 30
    assert stats.ahead_rows_dropped > 0  # a row of the step queued after the stop, dropped
    # and the step after that one is queued ahead too, fed the other rows' tokens by position:
    # every decode step but the first
    assert stats.ahead_steps == len(stats.decode_step_s) - 1


def test_requests_joining_sharing_and_preempted_give_the_same_bytes(monkeypatch):
    """More requests than max_num_seqs (they join as others finish), one GRPO prompt for four
    of them (prefix sharing), a step token budget, and a KV cache small enough to preempt."""
    model = tiny("bf16")
    prompts = [LONG] * 4 + [PROMPTS[0], PROMPTS[1]]
    params = _params([9, 14, 5, 20, 12, 3])
    preempted = []
    original = Scheduler._preempt
    monkeypatch.setattr(
        Scheduler, "_preempt", lambda self, seq: (preempted.append(seq.index), original(self, seq))
    )
    per_block = 2 * 4 * 16 * 2 * 16 * 4  # k+v, 4 layers, 16 tokens, 2 kv heads, dim 16, fp32
    distinct = [[(i * 11 + j) % 60 + 1 for j in range(15)] for i in range(4)]
    for cache, ps, qs in (
        ({"max_num_seqs": 2}, prompts, params),
        ({"max_num_seqs": 3, "max_num_batched_tokens": 24}, prompts, params),
        ({"kv_cache_bytes": 5 * per_block}, distinct, _params([6, 14, 9, 11])),
    ):

        def make(overlap, c=cache):
            return Engine(model, "bf16", tile=8, cache=CacheOptions(**c), overlap=overlap)

        want, got, stats = _both(make, ps, qs)
        _same(got, want, f"cache {cache}")
        assert stats.ahead_steps > 0, cache
    assert preempted, "the last cache was meant to be too small for every request at once"


def test_greedy_requests_and_the_default():
    assert Engine(tiny("bf16"), "bf16").overlap is False  # on the CPU: nothing to overlap
    want, got, stats = _both(
        lambda overlap: Engine(tiny("bf16"), "bf16", tile=8, overlap=overlap),
        [PROMPTS[0], PROMPTS[1]],
        _params([12, 17], temperature=0.0),
    )
    _same(got, want, "greedy")
    assert stats.ahead_steps > 0


def test_graph_capture_up_front_is_a_no_op_without_graphs():
    engine = Engine(tiny("bf16"), "bf16")
    assert engine.capture_graphs(64) == 0  # the CPU decodes eagerly
    with pytest.raises(ValueError, match="max_tokens"):
        engine.capture_graphs(0)
