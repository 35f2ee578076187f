"""The CUDA-graph decode's host-side logic on the CPU: the bucket list (every batch size maps to
a captured size >= it, the largest size included), the bucket a step replays, the metadata rows
it fills (token, position, KV slot, block table; padding rows on the scratch block) and which
graphs `fits` admits. Capture and replay themselves are in tests/engine/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from mxrl.engine import SamplingParams
from mxrl.engine.graph import META, DecodeGraphs, buckets
from mxrl.engine.scheduler import Scheduled
from mxrl.engine.sequence import Sequence

# the bucket lists written out (1 2 4 8, then steps of 8 to 32, of 16 to 128, of 32 beyond;
# the largest decode batch itself always last)
BUCKETS = {
    1: [1],
    3: [1, 2, 3],
    8: [1, 2, 4, 8],
    9: [1, 2, 4, 8, 9],
    32: [1, 2, 4, 8, 16, 24, 32],
    100: [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100],
    256: [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256],
    300: [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 288, 300],
}


@pytest.mark.parametrize("max_batch", sorted(BUCKETS))
def test_bucket_lists(max_batch):
    assert buckets(max_batch) == BUCKETS[max_batch]


@pytest.mark.parametrize("max_batch", [1, 2, 7, 8, 33, 129, 256, 513])
def test_every_batch_size_has_a_bucket_and_pads_less_than_a_step(max_batch):
    sizes = buckets(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
    for r in range(1, max_batch + 1):
        p = min(s for s in sizes if s >= r)  # exists for every r: else min() raises
        # padding rows: under half the bucket up to 8, then under the step of its range
        step = p / 2 if p <= 8 else 8 if p <= 32 else 16 if p <= 128 else 32
        assert 0 <= p - r < step, (max_batch, r, p)


class _Graph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def _graphs(max_batch=4, width=3, block_size=4, scratch=9) -> DecodeGraphs:
    """A DecodeGraphs without a GPU: the constructor pins its staging buffers and opens a CUDA
    graph pool, so the host-side state is set here as it sets it, and every bucket holds a
    stand-in graph whose outputs are the row numbers."""
    g = DecodeGraphs.__new__(DecodeGraphs)
    g.max_batch, g.width, g.scratch, g.block_size = max_batch, width, scratch, block_size
    g.sizes = buckets(max_batch)
    g._staging = [torch.zeros((max_batch, META + width), dtype=torch.int32) for _ in range(2)]
    g._known = [[None] * max_batch for _ in range(2)]
    g.meta = torch.zeros((max_batch, META + width), dtype=torch.int32)
    g.failure = None
    for turn in (1, 0):
        g._turn = turn
        g._pad_rows(0, max_batch)
    rows = torch.arange(max_batch, dtype=torch.float32)
    g.graphs = {p: (_Graph(), rows[:p, None].clone(), rows[:p, None, None].long()) for p in g.sizes}
    return g


def _decoding(tokens, table, index=0) -> Scheduled:
    """A sequence decoding its last token (one token fed, then sampled)."""
    seq = Sequence(index, list(tokens), SamplingParams(), 0)
    seq.block_table = list(table)
    return Scheduled(seq, len(tokens) - 1, 1)


PAD = [0, 0, 9 * 4, 9]  # token 0 at position 0, slot 0 of the scratch block 9


def test_a_step_replays_the_smallest_bucket_that_holds_it():
    g = _graphs(max_batch=100, width=1)
    for r in range(1, 101):
        before = {p: graph.replays for p, (graph, _, _) in g.graphs.items()}
        logits, routing = g.run([_decoding([1, 2], [0], index=i) for i in range(r)])
        p = min(s for s in BUCKETS[100] if s >= r)
        replayed = [q for q, (graph, _, _) in g.graphs.items() if graph.replays != before[q]]
        assert replayed == [p], r
        assert torch.equal(logits[:, 0], torch.arange(r, dtype=torch.float32))  # rows [:r]
        assert routing.shape == (r, 1, 1)


def test_metadata_rows_and_padding():
    g = _graphs()
    a = _decoding([5, 6, 7, 8, 9, 10], [2, 0])  # position 5: block 0's slot 1
    b = _decoding([1, 2, 3], [7], index=1)  # position 2 of block 7: slot 30
    g.run([a, b])  # 2 rows: bucket 2
    assert g.meta[0, :5].tolist() == [10, 5, 0 * 4 + 1, 2, 0]
    assert g.meta[1, :4].tolist() == [3, 2, 7 * 4 + 2, 7]
    c = _decoding([4, 4, 4, 4, 4], [3, 6], index=2)  # position 4: block 6's slot 0 = 24
    g.run([a, b, c])  # 3 rows: bucket 4, its last row padding
    assert g.meta[2, :5].tolist() == [4, 4, 24, 3, 6]
    assert g.meta[3, :4].tolist() == PAD


def test_a_row_is_rewritten_when_its_sequence_or_its_table_changes():
    """Two staging buffers are filled by turns, so every other step reuses a buffer: a row
    that held a sequence is padding again in a smaller step of the same bucket, a row follows
    its sequence's grown block table, and rows follow sequences that change places."""
    g = _graphs()
    a = _decoding([1, 2, 3, 4, 5, 6, 7, 8], [2, 0])  # position 7: block 0's slot 3
    b = _decoding([9, 9, 9], [5], index=1)  # position 2: slot 22
    c = _decoding([3, 3], [1], index=2)  # position 1: slot 5
    d = _decoding([7], [8], index=3)  # position 0: slot 32
    rows = {
        "a": [8, 7, 3, 2, 0],
        "b": [9, 2, 22, 5],
        "c": [3, 1, 5, 1],
        "d": [7, 0, 32, 8],
    }
    g.run([a, b, c, d])  # buffer 1
    g.run([a, b, c, d])  # buffer 0
    g.run([a, b, c])  # buffer 1, bucket 4: d's row is padding again
    assert g.meta[:4, :4].tolist() == [rows["a"][:4], rows["b"], rows["c"], PAD]
    g.run([a, b, c])  # buffer 0, likewise
    assert g.meta[3, :4].tolist() == PAD
    a.seq.tokens.append(11)  # a decodes into a new block: position 8, block 4's slot 0
    a.seq.block_table.append(4)
    grown = Scheduled(a.seq, 8, 1)
    for _ in range(2):  # each buffer held a's shorter table in this row
        g.run([grown, b, c])
        assert g.meta[0, :6].tolist() == [11, 8, 16, 2, 0, 4]
    g.run([b, c, grown])  # buffer 1: the rows change places
    assert g.meta[:3, :4].tolist() == [rows["b"], rows["c"], [11, 8, 16, 2]]
    assert g.meta[2, META : META + 3].tolist() == [2, 0, 4]


def test_an_ahead_row_feeds_the_device_token():
    g = _graphs()
    a = _decoding([1, 2, 3], [6])
    ahead = Scheduled(a.seq, 3, 1, ahead=True)  # its token is not in seq.tokens yet
    g.run([ahead], ahead=torch.tensor([42]))
    assert g.meta[0, :4].tolist() == [42, 3, 6 * 4 + 3, 6]


def test_fits_only_one_token_decode_rows_within_the_table_width():
    g = _graphs(max_batch=2, width=2)
    ok = _decoding([1, 2, 3], [0])
    assert g.fits([ok]) and g.fits([ok, _decoding([4, 5], [1, 2], index=1)])
    assert not g.fits([])
    assert not g.fits([ok, ok, ok])  # more rows than the largest bucket
    assert not g.fits([Scheduled(ok.seq, 1, 2)])  # a prefill chunk of two tokens
    assert not g.fits([Scheduled(ok.seq, 0, 1)])  # a prefill row that does not sample
    assert not g.fits([_decoding([1] * 9, [0, 1, 2])])  # a table wider than the buffer
    g.failure = "capture failed"
    assert not g.fits([ok])
