"""Edges of mxrl/engine/graph.py's host side from its mutation run (docs/mutation/engine.graph.md),
on the CPU: the bucket every batch size pads to (written out), the constructor's state (its
staging buffers pinned and filled with padding rows, built here with the pinning and the graph
pool stood in for: neither exists without CUDA), a bucket captured at its first step and only
then, the device token of a step queued ahead surviving that capture, the fall-back to eager
decoding when a capture fails (`try_run`, `capture_all`), what each buffer turn holds, and
`_decode_graphs`' table width and rebuilds, the forward a graph captures (a stand-in model
records what it is fed) and the capture's sequence of streams, warm-ups and graph (torch.cuda's
streams and graphs stood in for by recorders). That the captured graphs replay the eager bytes
is the GPU tier's (the graph tests of tests/engine/test_gpu.py). Every expectation is written
out by hand from the module's docstrings."""

from __future__ import annotations

import types
from typing import ClassVar

import torch

import mxrl.engine.graph as graph_module
from mxrl.engine import SamplingParams
from mxrl.engine.graph import META, DecodeGraphs, GraphCapture, buckets
from mxrl.engine.scheduler import Scheduled
from mxrl.engine.sequence import Sequence
from tests.engine.test_graph import PAD, _Graph, _graphs


def _decoding(tokens, table, index=0) -> Scheduled:
    """A sequence decoding its last token (one token fed, then sampled)."""
    seq = Sequence(index, list(tokens), SamplingParams(), 0)
    seq.block_table = list(table)
    return Scheduled(seq, len(tokens) - 1, 1)


# --- buckets ---------------------------------------------------------------------------------


def test_every_batch_size_pads_to_the_bucket_written_out():
    """max_batch 40: buckets 1, 2, 4, 8, 16, 24, 32, 40 (steps of 8 to 32, then the largest
    batch). Each batch size 1..40 replays the smallest of them that holds it."""
    assert buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    want = {1: 1, 2: 2, 3: 4, 4: 4, **dict.fromkeys(range(5, 9), 8)}
    want |= dict.fromkeys(range(9, 17), 16) | dict.fromkeys(range(17, 25), 24)
    want |= dict.fromkeys(range(25, 33), 32) | dict.fromkeys(range(33, 41), 40)
    g = _graphs(max_batch=40, width=1)
    for r in range(1, 41):
        g.run([_decoding([1, 2], [0], index=i) for i in range(r)])
        replayed = {p for p, (graph, _, _) in g.graphs.items() if graph.replays}
        assert replayed == {want[r]}, r
        for graph, _, _ in g.graphs.values():
            graph.replays = 0


def test_buckets_at_each_step_change():
    """The step grows after 32 (to 16) and after 128 (to 32): 33 and 129 get their own last
    bucket past the previous multiple; 2 and 4 are their own lists' ends."""
    assert buckets(2) == [1, 2]
    assert buckets(4) == [1, 2, 4]
    assert buckets(33) == [1, 2, 4, 8, 16, 24, 32, 33]
    assert buckets(48) == [1, 2, 4, 8, 16, 24, 32, 48]
    assert buckets(129)[-3:] == [112, 128, 129]
    assert buckets(160)[-2:] == [128, 160]
    assert buckets(161)[-3:] == [128, 160, 161]


# --- the constructor -------------------------------------------------------------------------


def _built(monkeypatch, max_batch=3, width=2, block_size=4, scratch=7):
    """DecodeGraphs' own constructor on the CPU: torch.zeros without its pin_memory (recorded)
    and a stand-in graph pool; the cache is a stand-in with the fields the constructor reads."""
    zeros, pinned = torch.zeros, []

    def unpinned(*args, pin_memory=False, **kw):
        pinned.append(pin_memory)
        return zeros(*args, **kw)

    monkeypatch.setattr(torch, "zeros", unpinned)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    cache = types.SimpleNamespace(k=[torch.empty(0)], block_size=block_size)
    g = DecodeGraphs("net", cache, max_batch, width, scratch)
    monkeypatch.setattr(torch, "zeros", zeros)
    return g, pinned


def test_the_constructor_pins_two_staging_buffers_of_padding_rows(monkeypatch):
    """Two pinned int32 staging buffers [max_batch, 3 + width], every row a padding row (token
    0, position 0, slot scratch * block_size, the scratch block first in its table); the
    device's meta buffer zero, the row numbers and ones on the cache's device; turn 0 first,
    no row known, no graph, no failure."""
    g, pinned = _built(monkeypatch)
    assert pinned == [True, True, False]  # the staging buffers, then meta
    assert (g.net, g.max_batch, g.width, g.scratch, g.block_size) == ("net", 3, 2, 7, 4)
    assert g.device == torch.device("cpu") and g.sizes == [1, 2, 3]
    assert len(g._staging) == 2 and g._staging[0] is not g._staging[1]
    for buf in g._staging:
        assert buf.dtype == torch.int32 and buf.tolist() == [[0, 0, 28, 7, 0]] * 3
    assert g._known == [[None] * 3, [None] * 3] and g._known[0] is not g._known[1]
    assert g._turn == 0 and g.meta_host is g._staging[0]
    assert g.meta.shape == (3, META + 2) and g.meta.dtype == torch.int32
    assert g.meta.device == g.arange.device == g.ones.device == torch.device("cpu")
    assert g.arange.shape == (3,) and g.arange.dtype == torch.int32
    assert g.ones.shape == (3,) and g.ones.dtype == torch.int32
    assert g.pool == "pool" and g.graphs == {} and g.failure is None


def test_the_constructor_fills_both_buffers_on_the_host(monkeypatch):
    """The values of the device tensors the constructor makes, built on the CPU cache: meta
    zero, arange 0..max_batch-1, ones."""
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **kw: zeros(*a, **kw))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    cache = types.SimpleNamespace(k=[torch.zeros(2)], block_size=2)
    g = DecodeGraphs(None, cache, 4, 1, 5)
    monkeypatch.setattr(torch, "zeros", zeros)
    assert g.meta.tolist() == [[0] * 4] * 4
    assert g.arange.tolist() == [0, 1, 2, 3] and g.ones.tolist() == [1, 1, 1, 1]
    assert g._staging[1].tolist() == [[0, 0, 10, 5]] * 4


def test_the_device_buffers_go_to_the_caches_device_not_the_default_one(monkeypatch):
    """meta, the row numbers and the ones live where the cache does (on a GPU engine the
    default device is the CPU): with the default device elsewhere (meta) they are still on
    the cache's (the CPU). The staging buffers are host memory (the pinned stand-in's)."""
    # a device context's first call lists the factory functions it redirects (once per
    # process): make that call before torch.zeros is replaced, so the list holds the real one
    with torch.device("cpu"):
        torch.empty(0)
    zeros = torch.zeros

    def host_when_pinned(*args, pin_memory=False, **kw):
        # pinned: host memory; else the device asked for, or the default one (spelled out:
        # the default-device mode may not see the original function once it is replaced)
        if pin_memory or kw.get("device") is None:
            kw["device"] = "cpu" if pin_memory else torch.get_default_device()
        return zeros(*args, **kw)

    monkeypatch.setattr(torch, "zeros", host_when_pinned)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    cache = types.SimpleNamespace(k=[torch.zeros(2)], block_size=2)
    torch.set_default_device("meta")
    try:
        g = DecodeGraphs(None, cache, 3, 1, 2)
    finally:
        torch.set_default_device(None)
    assert [t.device.type for t in (g.meta, g.arange, g.ones)] == ["cpu"] * 3
    assert g.meta.tolist() == [[0] * 4] * 3 and g.arange.tolist() == [0, 1, 2]


# --- run: lazy capture, the ahead token, turns ---------------------------------------------


def _capturing(g: DecodeGraphs, captured: list[int], routing: bool = True):
    """A stand-in `_capture`: what the real one leaves behind (a graph for p whose outputs are
    the row numbers, and meta rewritten from the staging buffer), without CUDA."""

    def capture(p):
        captured.append(p)
        rows = torch.arange(p, dtype=torch.float32)
        g.graphs[p] = (
            _Graph(),
            rows[:, None] + 100,
            rows[:, None, None].long() if routing else None,
        )
        g.meta[:p].copy_(g.meta_host[:p])
        return g.graphs[p]

    g._capture = capture


def test_a_bucket_is_captured_at_its_first_step_only():
    """With no graph held, a 3-row step captures bucket 4 and replays it; a 4-row step replays
    it again without capturing; a 1-row step captures bucket 1. The outputs are the graph's
    rows [:R]; a dense model's routing (None) is None."""
    g = _graphs(max_batch=4)
    g.graphs = {}
    captured: list[int] = []
    _capturing(g, captured, routing=False)
    rows = [_decoding([1, 2], [0], index=i) for i in range(4)]
    logits, routing = g.run(rows[:3])
    assert captured == [4] and g.graphs[4][0].replays == 1
    assert logits.tolist() == [[100.0], [101.0], [102.0]] and routing is None
    g.run(rows)
    assert captured == [4] and g.graphs[4][0].replays == 2
    g.run(rows[:1])
    assert captured == [4, 1] and g.graphs[1][0].replays == 1


def test_an_ahead_token_survives_a_capture():
    """A step queued ahead at a bucket's first step: the capture rewrites meta from the
    staging buffer (where the ahead row's token is 0: it is not on the host), then the device
    tokens go into the token column of rows [:R] only."""
    g = _graphs(max_batch=4)
    g.graphs = {}
    _capturing(g, [])
    a = _decoding([1, 2, 3], [6])
    b = _decoding([4, 5], [2], index=1)
    rows = [Scheduled(a.seq, 3, 1, ahead=True), Scheduled(b.seq, 2, 1, ahead=True)]
    g.run(rows, ahead=torch.tensor([42, 43]))
    assert g.meta[:2, :4].tolist() == [[42, 3, 27, 6], [43, 2, 10, 2]]
    assert g.meta_host[:2, 0].tolist() == [0, 0]  # the host never had them


def test_steps_fill_the_buffers_by_turns_and_copy_only_their_bucket():
    """Each step fills the other staging buffer (turn 1, 0, 1, ...) and copies its bucket's
    rows [:P] to meta; rows past P keep what an earlier, larger step left there."""
    g = _graphs(max_batch=4)
    assert g._turn == 0
    rows = [_decoding([5, 6, 7], [i + 1], index=i) for i in range(4)]
    g.run(rows)
    assert g._turn == 1 and g._staging[1][:, 0].tolist() == [7, 7, 7, 7]
    assert g._staging[0][:, 0].tolist() == [0, 0, 0, 0]
    assert g.meta[:, 3].tolist() == [1, 2, 3, 4]
    g.run([_decoding([8, 9], [5])])  # bucket 1: meta row 0 only
    assert g._turn == 0 and g._staging[0][0, :4].tolist() == [9, 1, 21, 5]
    assert g.meta[:, 3].tolist() == [5, 2, 3, 4]
    assert g._staging[1][:, 0].tolist() == [7, 7, 7, 7]  # the other turn's rows untouched


# --- failures --------------------------------------------------------------------------------


def test_a_failed_capture_falls_back_to_eager_decoding():
    """try_run returns None when the capture raises a RuntimeError; the failure is its first
    line, every graph is dropped and no step fits any more."""
    g = _graphs(max_batch=2)
    g.graphs = {1: g.graphs[1]}

    def fail(p):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    g._capture = fail
    row = _decoding([1, 2], [0])
    assert g.try_run([row]) is not None and g.failure is None  # bucket 1 held: a replay
    assert g.try_run([row, _decoding([3, 4], [1], index=1)]) is None
    assert g.failure == "operation not permitted when stream is capturing"
    assert g.graphs == {} and not g.fits([row])


def test_capture_all_captures_what_is_missing_in_bucket_order():
    """capture_all captures every bucket not held yet, smallest first, and stops at a failure
    (no graph kept, later buckets not tried); after a failure it captures nothing."""
    g = _graphs(max_batch=8)  # buckets 1, 2, 4, 8
    g.graphs = {2: g.graphs[2]}
    captured: list[int] = []
    _capturing(g, captured)
    g.capture_all()
    assert captured == [1, 4, 8] and sorted(g.graphs) == [1, 2, 4, 8]
    g.capture_all()
    assert captured == [1, 4, 8]

    g = _graphs(max_batch=8)
    g.graphs = {}
    tried: list[int] = []

    def fail_at_4(p):
        tried.append(p)
        if p == 4:
            raise RuntimeError("capture failed\nwhy")
        g.graphs[p] = (_Graph(), None, None)

    g._capture = fail_at_4
    g.capture_all()
    assert tried == [1, 2, 4] and g.graphs == {} and g.failure == "capture failed"
    g.capture_all()
    assert tried == [1, 2, 4]


# --- the engine's half: _decode_graphs -----------------------------------------------------


class _Recorded:
    """A stand-in DecodeGraphs: records its arguments and whether the engine still held the
    old graphs when it was built."""

    built: ClassVar[list[tuple]] = []

    def __init__(self, net, kv, max_batch, width, scratch):
        self.width = width
        _Recorded.built.append((net, kv, max_batch, width, scratch, _Engine.current._graphs))


class _Engine(GraphCapture):
    current: _Engine

    def __init__(self, cuda_graphs=True, block_size=16, max_num_seqs=5):
        self.net, self.cuda_graphs, self._graphs = "net", cuda_graphs, None
        self.cache_options = types.SimpleNamespace(block_size=block_size, max_num_seqs=max_num_seqs)
        _Engine.current = self


def test_decode_graphs_widths_and_rebuilds(monkeypatch):
    """Blocks of 16: a table holds max(64, the next power of two of ceil(max_len / 16))
    blocks. 1 and 1024 tokens fit 64 (one build, then kept), 1025 needs 65: 128 (rebuilt,
    the old graphs dropped first), 2048 fits it, 2049 needs 129: 256. The scratch block is
    the cache's last; the batch is the scheduler's max_num_seqs. No graphs without CUDA graphs
    or for max_len 0."""
    monkeypatch.setattr(graph_module, "DecodeGraphs", _Recorded)
    _Recorded.built = []
    kv = types.SimpleNamespace(k=[torch.zeros(10, 16, 1, 1)])
    e = _Engine()
    assert e._decode_graphs(kv, 0) is None and _Recorded.built == []
    first = e._decode_graphs(kv, 1)
    assert _Recorded.built == [("net", kv, 5, 64, 9, None)]
    assert e._graphs is first and e._decode_graphs(kv, 1024) is first
    second = e._decode_graphs(kv, 1025)
    assert second is not first and e._graphs is second
    assert _Recorded.built[-1] == ("net", kv, 5, 128, 9, None)  # the old ones dropped first
    assert e._decode_graphs(kv, 2048) is second and len(_Recorded.built) == 2
    assert e._decode_graphs(kv, 2049).width == 256
    e._invalidate_graphs()
    assert e._graphs is None
    assert _Engine(cuda_graphs=False)._decode_graphs(kv, 100) is None
    assert len(_Recorded.built) == 3


def test_decode_graphs_width_for_small_blocks(monkeypatch):
    """Blocks of 4: 257 tokens need 65 blocks (128 wide); 4 * 64 = 256 tokens 64. Blocks of
    16: 2048 tokens need 128 blocks (128 wide), 2049 need 129 (256)."""
    monkeypatch.setattr(graph_module, "DecodeGraphs", _Recorded)
    _Recorded.built = []
    kv = types.SimpleNamespace(k=[torch.zeros(3, 4, 1, 1)])
    assert _Engine(block_size=4)._decode_graphs(kv, 256).width == 64
    assert _Engine(block_size=4)._decode_graphs(kv, 257).width == 128
    # a power of two past 64 is its own width: 128 blocks of 16 tokens, then 129
    assert _Engine()._decode_graphs(kv, 128 * 16).width == 128
    assert _Engine()._decode_graphs(kv, 128 * 16 + 1).width == 256
    assert [b[4] for b in _Recorded.built] == [2, 2, 2, 2]


def test_try_run_passes_the_ahead_tokens_on():
    """try_run (what the runner calls) is run: a step queued ahead gets its device tokens in
    the token column through it too."""
    g = _graphs()
    a = _decoding([1, 2, 3], [6])
    logits, _ = g.try_run([Scheduled(a.seq, 3, 1, ahead=True)], ahead=torch.tensor([42]))
    assert g.meta[0, :4].tolist() == [42, 3, 27, 6] and logits.tolist() == [[0.0]]


def test_padding_marks_only_its_own_rows():
    """Padding rows [R, P) are marked as padding, the step's own rows [0, R) stay known as
    theirs: a later step of the same turn whose padding falls on one of them must pad it
    again. Buckets 1, 2, 4, 8; turn 1 runs 8 rows, then 5 (rows 5-7 padded), then 3: row 3,
    live in the 5-row step, is padding in bucket 4 and must not keep that row."""
    g = _graphs(max_batch=8, width=1)
    rows = [_decoding([5, 6], [i], index=i) for i in range(8)]
    g.run(rows)  # turn 1
    g.run(rows)  # turn 0
    g.run(rows[:5])  # turn 1, bucket 8: rows 5-7 padded
    g.run(rows[:5])  # turn 0
    g.run(rows[:3])  # turn 1, bucket 4: row 3 held request 3
    assert g.meta[:4, :4].tolist() == [[6, 1, 1, 0], [6, 1, 5, 1], [6, 1, 9, 2], PAD]
    assert g._known[1][3] is None and g._known[1][4] is not None  # row 4: not in bucket 4


# --- the forward a graph captures, and the capture, with stand-ins for the model and CUDA ------


class _Net:
    """A stand-in CausalLM: records what the forward is fed and the context it runs in;
    hidden = token * 10 (float64), logits = hidden * 2, layer l routes a token t to t + 100 l."""

    def __init__(self, layers: int = 2) -> None:
        self.layers, self.seen = layers, None
        self.model = self._model

    def _model(self, ids, position_ids=None):
        from mxrl.models.context import get_forward_context

        self.seen = (ids, position_ids, get_forward_context())
        hidden = ids.double()[..., None] * 10
        return hidden, [ids[..., None] + 100 * layer for layer in range(self.layers)]

    def logits(self, hidden):
        return hidden * 2


def _forwarding(layers: int = 2) -> DecodeGraphs:
    g = _graphs(max_batch=4, width=2)
    g.net, g.cache = _Net(layers), "cache"
    g.arange, g.ones = torch.arange(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    g.meta = torch.tensor(
        [[5, 7, 29, 7, 1], [6, 3, 13, 3, 0], [0, 0, 36, 9, 0], [8, 8, 8, 8, 8]],
        dtype=torch.int32,
    )
    return g


def test_the_forward_reads_every_column_of_its_bucket_rows():
    """A bucket-3 forward over meta rows (token, position, slot, table): the model is fed rows
    [:3]'s tokens at their positions (int64, one batch row), the attention writes their slots
    and reads their tables, one query tile per row (token i, 1 token, its position, request i);
    the logits come back float32, the routing [P, layers, k] (layer on dim 1)."""
    g = _forwarding()
    logits, routing = g._forward(3)
    ids, position_ids, ctx = g.net.seen
    assert ids.dtype == torch.int64 and ids.tolist() == [[5, 6, 0]]
    assert position_ids.tolist() == [[7, 3, 0]]
    assert ctx.positions.dtype == torch.int64 and ctx.positions.tolist() == [7, 3, 0]
    att = ctx.attention
    assert att.cache == "cache" and att.kernel is True
    assert att.slot_mapping.dtype == torch.int64 and att.slot_mapping.tolist() == [29, 13, 36]
    assert att.block_tables.tolist() == [[7, 1], [3, 0], [9, 0]]
    tiles = att.tiles
    assert (tiles.token.tolist(), tiles.rows.tolist()) == ([0, 1, 2], [1, 1, 1])
    assert (tiles.pos.tolist(), tiles.req.tolist()) == ([7, 3, 0], [0, 1, 2])
    assert logits.dtype == torch.float32 and logits.tolist() == [[100.0], [120.0], [0.0]]
    assert routing.tolist() == [[[5], [105]], [[6], [106]], [[0], [100]]]


def test_a_dense_models_forward_has_no_routing():
    g = _forwarding(layers=0)
    logits, routing = g._forward(2)
    assert routing is None and logits.tolist() == [[100.0], [120.0]]


def _cuda_stand_ins(monkeypatch, log: list) -> None:
    """torch.cuda's streams and graphs as recorders of what the capture does with them."""
    import contextlib

    class Stream:
        def __init__(self, device=None, name="side"):
            self.device, self.name = device, name
            if name == "side":
                log.append(("Stream", device))

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    def current_stream(device=None):
        log.append(("current_stream", device))
        return Stream(device, "current")

    @contextlib.contextmanager
    def stream(s):
        log.append(("enter", s.name))
        yield
        log.append(("exit", s.name))

    class CUDAGraph:
        def replay(self):
            log.append(("replay",))

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None):
        log.append(("capture", type(cuda_graph).__name__, pool))
        yield
        log.append(("captured",))

    for name, value in (("Stream", Stream), ("current_stream", current_stream),
                        ("stream", stream), ("CUDAGraph", CUDAGraph), ("graph", graph)):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)


def test_a_capture_warms_up_twice_on_padding_then_captures_once(monkeypatch):
    """A bucket's capture (`_capture`): two warm-up forwards on a side stream that waits for
    the current one, then the current stream waits for it, then one forward captured into a
    new graph from the engine's pool; every one of them on padding rows only (the warm-up
    writes KV slots: the scratch block's alone). After it, the staging buffer, the rows'
    records and meta hold the step being run again, and the step replays the graph."""
    log: list = []
    _cuda_stand_ins(monkeypatch, log)
    g = _graphs(max_batch=4)
    g.device, g.pool, g.graphs = "dev", "pool", {}
    out = torch.arange(4, dtype=torch.float32)[:, None]

    def forward(p):
        log.append(("forward", p, g.meta[:p, :4].tolist()))
        return out, None

    g._forward = forward
    rows = [_decoding([1, 2], [3]), _decoding([4, 5, 6], [7], index=1), _decoding([8], [2], 2)]
    logits, routing = g.run(rows)  # 3 rows: bucket 4, captured now
    padding = ("forward", 4, [PAD] * 4)
    assert log == [
        ("Stream", "dev"),
        ("current_stream", "dev"),
        ("wait", "side", "current"),
        ("enter", "side"),
        padding,
        padding,
        ("exit", "side"),
        ("current_stream", "dev"),
        ("wait", "current", "side"),
        ("capture", "CUDAGraph", "pool"),
        padding,
        ("captured",),
        ("replay",),
    ]
    graph, held, none = g.graphs[4]
    assert type(graph).__name__ == "CUDAGraph" and held is out and none is None
    assert logits.tolist() == [[0.0], [1.0], [2.0]] and routing is None
    step = [[2, 1, 13, 3], [6, 2, 30, 7], [8, 0, 8, 2], PAD]
    assert g.meta_host[:, :4].tolist() == step and g.meta[:, :4].tolist() == step
    assert [r[0] for r in g._rows[:3]] == [s.seq for s in rows] and g._rows[3] is None
