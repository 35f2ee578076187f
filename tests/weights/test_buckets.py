"""Bucket boundaries of `mxrl.weights.export`: records join a bucket in plan order while they fit
in `bucket_bytes` (a record that fills the bucket exactly stays in it), a record one byte over
opens the next bucket, a record bigger than the limit travels alone. The assignments below are
worked out by hand from the records' sizes."""

import pytest
import torch

from mxrl.recipe import resolve
from mxrl.weights import export

# bf16 norm weights of n elements hold 2n bytes: 40, 60, 30, 70, 100 and 10 bytes
SIZES = [40, 60, 30, 70, 100, 10]
NAMES = [f"model.layers.{i}.input_layernorm.weight" for i in range(len(SIZES))]


def buckets_at(bucket_bytes: int) -> list[list[int]]:
    weights = {n: torch.ones(size // 2) for n, size in zip(NAMES, SIZES, strict=True)}
    plan = resolve("bf16", {n: t.shape for n, t in weights.items()})
    buckets = list(export(weights, plan, bucket_bytes=bucket_bytes, sqnr=False))
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert [b.last for b in buckets] == [False] * (len(buckets) - 1) + [True]
    assert buckets[-1].num_buckets == len(buckets)
    assert [r.nbytes for b in buckets for r in b.records] == SIZES
    return [[NAMES.index(r.name) for r in b.records] for b in buckets]


@pytest.mark.parametrize(
    ("bucket_bytes", "want"),
    [
        # 40+60 = 100 and 30+70 = 100 fill their buckets exactly: they stay together; 100 fills
        # one alone; 10 does not fit after it
        (100, [[0, 1], [2, 3], [4], [5]]),
        # each of those pairs is one byte over: split; 60+30 = 90 fits; 100 is over: alone
        (99, [[0], [1, 2], [3], [4], [5]]),
        # one byte to spare: the same pairs as an exact fit; 100+10 = 110 is over
        (101, [[0, 1], [2, 3], [4], [5]]),
        # everything fits in one bucket: 310 bytes exactly, then one under and one over
        (310, [[0, 1, 2, 3, 4, 5]]),
        (311, [[0, 1, 2, 3, 4, 5]]),
        (309, [[0, 1, 2, 3, 4], [5]]),
        # every record is bigger than the limit: each alone
        (8, [[0], [1], [2], [3], [4], [5]]),
    ],
)
def test_records_fill_buckets_up_to_exactly_the_limit(bucket_bytes, want):
    assert buckets_at(bucket_bytes) == want
