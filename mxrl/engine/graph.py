"""CUDA-graph decode: a step where every scheduled sequence feeds one token replays a graph
captured for the next bucketed batch size, instead of launching a few hundred kernels from
Python.

Legend: R decoding sequences, P the bucket (R padded up), W block-table width, V vocab, L MoE
layers, k experts per token.

All of a step's metadata lives in one static int32 buffer `[P_max, 3 + W]` — per row: token
id, position, KV slot, then the block table — filled on the host in one of two pinned staging
buffers (by turns: with the engine's overlapped decoding the host fills the next step's while
this step's copy may still be queued) and copied in one transfer; the graph reads its first P
rows. A step queued ahead (`Scheduled.ahead`) gets its token column on the device, from the
step before's sampled tokens. Padding rows feed token 0 at position 0 into a scratch block that
no sequence owns (the cache's last block), so they never touch a real sequence's keys. Outputs
are the graph's static logits `[P, V]` (fp32) and routing `[P, L, k]`; the caller queues what
reads rows `[:R]` (the sampler, the copies to the host) before the next replay.

Same bytes as the eager step: the graph replays exactly the kernels the eager forward launches
for the same P rows, and every engine GEMM, attention tile and element-wise op computes a row
from that row alone (docs/engine.md, "Batch invariance") — so padding to P changes nothing for
the real rows. The tests compare graph and eager steps byte for byte.

Graphs stay valid while the engine's weight buffers stay where they are (loads copy in place);
the engine drops them when a load has to replace a buffer.
"""

from __future__ import annotations

import logging

import torch

from mxrl.engine.kv_cache import KVCache, PagedAttention
from mxrl.engine.scheduler import Scheduled
from mxrl.models import CausalLM
from mxrl.models.context import ForwardContext, forward_context

logger = logging.getLogger(__name__)

META = 3  # columns before the block table: token id, position, slot


def buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every multiple of 8 up to 32,
    then of 16 up to 128, then of 32, and `max_batch` itself last (every size up to it has a
    bucket). A step pads fewer rows than its bucket's step: under half the bucket up to 8,
    under 8 rows up to 32, 16 up to 128, 32 beyond (at most 1/5 of the rows past 128)."""
    out, b = [1, 2, 4, 8], 8
    while b < max_batch:
        b += 8 if b < 32 else 16 if b < 128 else 32
        out.append(b)
    return [x for x in out if x < max_batch] + [max_batch]


class DecodeGraphs:
    """Decode graphs of one engine, captured lazily per bucket (module docstring).

    max_batch: the largest decode batch (the scheduler's max_num_seqs). width: block-table
    entries per row (`fits` refuses a step holding a longer table; the engine then rebuilds
    with a wider table).
    """

    def __init__(
        self, net: CausalLM, cache: KVCache, max_batch: int, width: int, scratch_block: int
    ) -> None:
        self.net, self.cache = net, cache
        self.device = cache.k[0].device
        self.max_batch, self.width, self.scratch = max_batch, width, scratch_block
        self.sizes = buckets(max_batch)
        self.block_size = cache.block_size
        # two pinned staging buffers, filled by turns: with overlapped decoding the host fills
        # the next step's metadata while the copy of this step's may not have run yet
        self._staging = [
            torch.zeros((max_batch, META + width), dtype=torch.int32, pin_memory=True)
            for _ in range(2)
        ]
        # per buffer, what each row's block table there was written for
        self._known: list[list[tuple[object, list[int]] | None]] = [
            [None] * max_batch for _ in range(2)
        ]
        self._turn = 0
        self.meta = torch.zeros((max_batch, META + width), dtype=torch.int32, device=self.device)
        self.arange = torch.arange(max_batch, dtype=torch.int32, device=self.device)
        self.ones = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        for turn in (1, 0):
            self._turn = turn
            self._pad_rows(0, max_batch)
        self.failure: str | None = None  # why capture failed: the engine decodes eagerly

    def try_run(
        self, batch: list[Scheduled], ahead: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """`run`, or None (and no more graphs for this engine) when capture fails: an op of
        the forward that cannot live in a graph (it reads a value back to the host)."""
        try:
            return self.run(batch, ahead)
        except RuntimeError as err:
            self._failed(err)
            return None

    def capture_all(self) -> None:
        """Capture every bucket not captured yet (`Engine.capture_graphs`); on a failure, as
        `try_run`: no graphs for this engine (nor after an earlier failure)."""
        if self.failure is not None:
            return
        try:
            for p in self.sizes:
                if p not in self.graphs:
                    self._capture(p)
        except RuntimeError as err:
            self._failed(err)

    def _failed(self, err: RuntimeError) -> None:
        self.failure = str(err).splitlines()[0]
        self.graphs.clear()
        logger.warning("engine: CUDA-graph capture failed, decoding eagerly: %s", self.failure)

    def fits(self, batch: list[Scheduled]) -> bool:
        return (
            self.failure is None
            and 0 < len(batch) <= self.max_batch
            and all(s.num_tokens == 1 and s.sample for s in batch)
            and all(len(s.seq.block_table) <= self.width for s in batch)
        )

    def run(
        self, batch: list[Scheduled], ahead: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [R, V] and routing [R, L, k] (views of the graph's outputs) of a decode step.
        ahead: int64 [R] on the device, the tokens a step launched `ahead` feeds (its rows'
        `seq.tokens` do not hold them yet); copied into the token column on the device."""
        r = len(batch)
        p = next(size for size in self.sizes if size >= r)
        self._turn ^= 1  # the other buffer: its last copy was queued before the last step read
        self._fill(batch, p)
        self.meta[:p].copy_(self.meta_host[:p], non_blocking=True)
        graph, logits, routing = self.graphs.get(p) or self._capture(p)
        if ahead is not None:  # after a capture, which rewrites `meta` from the staging buffer
            self.meta[:r, 0].copy_(ahead)
        graph.replay()
        return logits[:r], None if routing is None else routing[:r]

    # --- metadata --------------------------------------------------------------------------
    @property
    def meta_host(self) -> torch.Tensor:
        """The pinned staging buffer of this turn."""
        return self._staging[self._turn]

    @property
    def _meta_np(self):
        return self._staging[self._turn].numpy()

    @property
    def _rows(self) -> list[tuple[object, list[int]] | None]:
        return self._known[self._turn]

    def _fill(self, batch: list[Scheduled], p: int) -> None:
        meta, bs = self._meta_np, self.block_size
        for i, s in enumerate(batch):
            seq, pos = s.seq, s.start
            table = seq.block_table
            meta[i, 0] = seq.tokens[pos] if pos < len(seq.tokens) else 0  # else: ahead
            meta[i, 1] = pos
            meta[i, 2] = table[pos // bs] * bs + pos % bs
            known = self._rows[i]
            if known is None or known[0] is not seq or known[1] != table:
                meta[i, META : META + len(table)] = table
                self._rows[i] = (seq, list(table))
        if any(self._rows[i] is not None for i in range(len(batch), p)):
            self._pad_rows(len(batch), p)

    def _pad_rows(self, start: int, stop: int) -> None:
        meta = self._meta_np
        meta[start:stop, :META] = (0, 0, self.scratch * self.block_size)
        meta[start:stop, META] = self.scratch
        for i in range(start, stop):
            self._rows[i] = None

    # --- capture ---------------------------------------------------------------------------
    def _forward(self, p: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        from mxrl.kernels.attention import AttentionTiles

        meta = self.meta[:p]
        positions = meta[:, 1].long()
        tiles = AttentionTiles(
            self.arange[:p], self.ones[:p], meta[:, 1].contiguous(), self.arange[:p]
        )
        attention = PagedAttention.on_device(self.cache, meta[:, 2].long(), meta[:, META:], tiles)
        with forward_context(ForwardContext(positions, attention)):
            hidden, routing = self.net.model(meta[:, 0].long()[None], position_ids=positions[None])
        logits = self.net.logits(hidden[0]).float()
        return logits, torch.stack([r[0] for r in routing], dim=1) if routing else None

    def _capture(self, p: int):
        """Warm up (Triton compiles, cuBLAS workspaces) on padding rows only — the warm-up
        really writes KV slots, so it must touch nothing but the scratch block — then capture."""
        saved, known = self.meta_host[:p].clone(), self._rows[:p]
        self._pad_rows(0, p)
        self.meta[:p].copy_(self.meta_host[:p])
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(p)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, routing = self._forward(p)
        self.graphs[p] = (graph, logits, routing)
        logger.info("engine: captured the decode graph for %d sequences", p)
        self.meta_host[:p].copy_(saved)  # the step being run, as _fill wrote it
        # and what its rows hold, so that a later fill with fewer rows pads the rest again
        # (marked padding, the step's rows would stay in the buffer as live rows)
        self._rows[:p] = known
        self.meta[:p].copy_(self.meta_host[:p])
        return self.graphs[p]


class GraphCapture:
    """The CUDA-graph half of `Engine` (it provides net, cuda_graphs, cache_options, _graphs
    and _cache)."""

    @torch.no_grad()
    def capture_graphs(self, max_tokens: int) -> int:
        """Capture the decode graph of every bucketed batch size now, for requests of up to
        `max_tokens` tokens (prompt and new tokens), instead of at the first decode step of
        each size inside `generate`, where a capture holds that step back (an RL rollout whose
        batch shrinks as requests stop meets every size once). Returns the number of graphs
        held: 0 where the engine decodes without graphs (the CPU, `cuda_graphs=False`, a
        capture that failed)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not self.cuda_graphs:
            return 0
        kv, _ = self._cache()
        graphs = self._decode_graphs(kv, max_tokens)
        if graphs is None:
            return 0
        graphs.capture_all()
        return len(graphs.graphs)

    def _decode_graphs(self, kv: KVCache, max_len: int) -> DecodeGraphs | None:
        """The decode graphs, rebuilt when requests of `max_len` tokens need wider block
        tables."""
        if not self.cuda_graphs or max_len < 1:
            return None
        bs = self.cache_options.block_size
        need = -(-max_len // bs)
        if self._graphs is None or self._graphs.width < need:
            width = max(64, 1 << (need - 1).bit_length())
            self._graphs = None  # free the old graphs' pool first
            scratch = kv.k[0].shape[0] - 1
            max_batch = self.cache_options.max_num_seqs
            self._graphs = DecodeGraphs(self.net, kv, max_batch, width, scratch)
        return self._graphs

    def _invalidate_graphs(self) -> None:
        """Drop the captured decode graphs (they read the buffers they were captured with);
        called when a weight load could not copy into the existing buffers."""
        self._graphs = None
