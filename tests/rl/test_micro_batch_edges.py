"""Edge cases of mxrl/rl/micro_batch.py that its mutation run (docs/mutation/rl.micro_batch.md)
found untested: a rank with no sequences, a largest run that holds one sequence, halving into
two, stats that fp32 would round, a batch without a valid token. Every expectation is worked out
by hand from the module's docstrings."""

from __future__ import annotations

import torch

from mxrl.rl import micro_batch
from mxrl.rl.micro_batch import MicroBatch, combine, padded_tokens, split

from .test_micro_batch import FakeRanks


def _rows(mbs):
    return [(mb.rows, mb.weight) for mb in mbs]


def test_padded_tokens_is_the_count_times_the_longest():
    assert padded_tokens([3, 5, 2, 7], [0, 1]) == 2 * 5
    assert padded_tokens([3, 5, 2, 7], [2, 3, 0]) == 3 * 7
    assert padded_tokens([3, 5, 2, 7], []) == 0  # no rows: no tokens


def test_split_without_a_budget():
    assert split([], None) == []
    assert split([5], None) == [(0,)]
    assert split([5, 1, 9], None) == [(0, 1, 2)]


def test_plan_halves_the_largest_run_into_two():
    # one run of 4, another rank needs 2: halved at 2 (not 1 and 3)
    mbs = micro_batch.plan([4, 4, 4, 4], 100, FakeRanks(2, others_max=torch.tensor([2])))
    assert _rows(mbs) == [((0, 1), 1.0), ((2, 3), 1.0)]
    # a run of 3: its first 3 // 2 = 1 sequence, then the other 2
    mbs = micro_batch.plan([4, 4, 4], 100, FakeRanks(2, others_max=torch.tensor([2])))
    assert _rows(mbs) == [((0,), 1.0), ((1, 2), 1.0)]
    # this rank needs more than the others: its own split, nothing added
    mbs = micro_batch.plan([3, 5, 2, 7], 10, FakeRanks(2, others_max=torch.tensor([1])))
    assert _rows(mbs) == [((3,), 1.0), ((0, 1), 1.0), ((2,), 1.0)]


def test_plan_splits_the_longest_run_when_the_largest_holds_one_sequence():
    # budget 10: [10] alone (10 tokens), then 1 1 1 (3 x 1 = 3). The largest by padded tokens
    # is the single sequence 0, which cannot be cut: the run with most sequences is halved
    lengths = [10, 1, 1, 1]
    mbs = micro_batch.plan(lengths, 10, FakeRanks(2, others_max=torch.tensor([3])))
    assert _rows(mbs) == [((0,), 1.0), ((1,), 1.0), ((2, 3), 1.0)]
    mbs = micro_batch.plan(lengths, 10, FakeRanks(2, others_max=torch.tensor([4])))
    assert _rows(mbs) == [((0,), 1.0), ((1,), 1.0), ((2,), 1.0), ((3,), 1.0)]
    # runs [10] [10] [1 1 1 1] (padded 10 10 4): the first single is the largest, so the run
    # with most sequences is halved ([1 1] [1 1]); then the first single again, and of the two
    # longest runs (2 sequences each) the first is halved
    lengths = [10, 1, 1, 10, 1, 1]
    assert split(lengths, 10) == [(0,), (3,), (1, 2, 4, 5)]
    mbs = micro_batch.plan(lengths, 10, FakeRanks(2, others_max=torch.tensor([5])))
    assert [mb.rows for mb in mbs] == [(0,), (3,), (1,), (2,), (4, 5)]


def test_the_filler_is_the_shortest_sequence_the_first_of_equals():
    # 3 sequences in one run (request order), another rank needs 5 forwards: halved into three
    # runs of one, then the shortest (row 1, 2 tokens) twice with its loss weighted 0, not the
    # longest (row 2) nor the first
    mbs = micro_batch.plan([5, 2, 9], 100, FakeRanks(2, others_max=torch.tensor([5])))
    assert _rows(mbs) == [((0,), 1.0), ((1,), 1.0), ((2,), 1.0), ((1,), 0.0), ((1,), 0.0)]
    # two of the shortest length: the first of them
    mbs = micro_batch.plan([4, 2, 2], 100, FakeRanks(2, others_max=torch.tensor([4])))
    assert _rows(mbs)[-1] == ((1,), 0.0)


def test_a_rank_without_sequences_runs_only_fillers():
    mbs = micro_batch.plan([], 100, FakeRanks(2, others_max=torch.tensor([2])))
    assert mbs == [MicroBatch((), 0.0), MicroBatch((), 0.0)]
    assert micro_batch.plan([], 100, FakeRanks()) == []
    assert micro_batch.plan([], None, FakeRanks()) == []


def test_combine_keeps_float64():
    """Sums, maxima and means in float64, as Python adds them: in fp32, 0.1 + 0.2 and 0.3
    would not come back as the same floats."""
    a = {"loss/pg": 0.1, "loss/num_tokens": 1.0, "ratio/max": 0.3, "ratio/mean": 0.1}
    b = {"loss/pg": 0.2, "loss/num_tokens": 3.0, "ratio/max": 0.1, "ratio/mean": 0.7}
    got = combine([(a, 1.0), (b, 3.0)], FakeRanks())
    want = {
        "loss/pg": 0.1 + 0.2,
        "loss/num_tokens": 4.0,
        "ratio/max": 0.3,
        "ratio/mean": (0.1 * 1.0 + 0.7 * 3.0) / 4.0,
    }
    assert got == want
    # the same stats from one micro-batch on each of two ranks
    other = FakeRanks(
        2,
        torch.tensor([0.1], dtype=torch.float64),
        torch.tensor([3.0, 0.2, 0.7 * 3.0, 3.0], dtype=torch.float64),
    )
    got = combine([(a, 1.0)], other)
    assert got == want


def test_combine_of_micro_batches_without_a_valid_token():
    """No valid token anywhere (every sequence empty, or only fillers): the token-weighted means
    are 0, not a division by zero; the sums and maxima as ever."""
    a = {"loss/pg": 0.0, "loss/num_tokens": 0.0, "ratio/max": 0.0, "ratio/mean": 0.0}
    got = combine([(a, 0.0), (dict(a), 0.0)], FakeRanks())
    assert got == a
    assert combine([(a, 0.0)], FakeRanks(2)) == a
