"""One engine step: the scheduled tokens of every sequence as one ragged row, run through the
model's own modules under a forward context (mxrl.models.context) — the engine has no decoder
of its own. A step where every sequence decodes one token replays a CUDA graph when the engine
has them (mxrl.engine.graph); any other step runs eagerly. Both give the same bytes. `Launched`
is a step queued on the device with its outputs on their way to the host.

Legend: T new tokens of all scheduled sequences, R sequences, V vocab, L MoE layers, k experts
per token.
"""

from __future__ import annotations

import torch

from mxrl.engine.graph import DecodeGraphs
from mxrl.engine.kv_cache import KVCache, PagedAttention
from mxrl.engine.scheduler import Scheduled
from mxrl.models import CausalLM
from mxrl.models.context import ForwardContext, forward_context


class ModelRunner:
    """Runs `net` (the engine's CausalLM: weight holders swapped in) over scheduled steps."""

    def __init__(
        self,
        net: CausalLM,
        cache: KVCache,
        device: torch.device,
        attention_kernel: bool,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.net, self.cache, self.device = net, cache, device
        self.attention_kernel = attention_kernel  # the Triton paged attention (triton backend)
        self.graphs = graphs
        c = net.config
        self.group = c.num_attention_heads // c.num_key_value_heads
        self.num_graph_steps = self.num_eager_steps = 0

    def step(
        self, batch: list[Scheduled], ahead: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fp32 logits [R', V] of the sequences that sample this step, in batch order;
        routing int64 [T, L, k] of every token fed, in batch order, or None for a dense model),
        both on the engine's device. ahead: for a step of `Scheduled.ahead` rows, the int64 [R]
        tokens they feed, on the device."""
        if self.graphs is not None and self.graphs.fits(batch):
            out = self.graphs.try_run(batch, ahead)
            if out is not None:
                self.num_graph_steps += 1
                return out
        self.num_eager_steps += 1
        return self._eager(batch, ahead)

    def _eager(
        self, batch: list[Scheduled], ahead: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        bs = self.cache.block_size
        ids, positions, slots, requests, last = [], [], [], [], []
        offset = 0
        for s in batch:
            seq, n = s.seq, s.num_tokens
            pos = range(s.start, s.start + n)
            if not s.ahead:
                ids.extend(seq.tokens[s.start : s.start + n])
            positions.extend(pos)
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in pos)
            requests.append((offset, n, s.start + n, seq.block_table))
            offset += n
            if s.sample:
                last.append(offset - 1)
        dev = self.device
        ids_t = ahead if ahead is not None else torch.tensor(ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        attention = PagedAttention(
            self.cache,
            torch.tensor(slots, dtype=torch.int64, device=dev),
            requests,
            group=self.group,
            kernel=self.attention_kernel,
        )
        with forward_context(ForwardContext(pos_t, attention)):
            hidden, routing = self.net.model(ids_t[None], position_ids=pos_t[None])
        logits = self.net.logits(hidden[0, last]).float() if last else hidden.new_zeros((0, 0))
        routed = torch.stack([r[0] for r in routing], dim=1) if routing else None
        return logits, routed


class Launched:
    """One step queued on the device: its rows, the rows that sample, the sampled tokens on the
    device (what an ahead step feeds), and their copies to the host. On CUDA the tokens,
    logprobs and routing go to pinned memory behind the step and an event marks their arrival,
    so reading them waits for this step only, not for an ahead step queued after it."""

    def __init__(self, batch, rows, tokens_t, lps_t, routing, started: float) -> None:
        self.batch, self.rows, self.tokens_t, self.started = batch, rows, tokens_t, started
        self.event = None
        if tokens_t.device.type == "cuda":
            out = [tokens_t, lps_t] + ([routing] if routing is not None else [])
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in out]
            for dst, src in zip(host, out, strict=True):
                dst.copy_(src, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(tokens_t.device))
            tokens_h, lps_h, *routing_h = host
            self._host = (tokens_h, lps_h, routing_h[0] if routing_h else None)
        else:
            self._host = (tokens_t, lps_t, routing)

    def read(self) -> tuple[list[int], list[float]]:
        """The sampled tokens and logprobs as host lists (waits for this step's copies)."""
        if self.event is not None:
            self.event.synchronize()
        return self._host[0].tolist(), self._host[1].tolist()

    def live_tokens(self, ahead: list[Scheduled]) -> torch.Tensor:
        """The tokens this step samples (on the device) for the requests of `ahead` (the step
        queued after it), in order: all of them, or, where a request has a row here and none
        there (a stop read since dropped it, or this step ends it by length), a gather of the
        others."""
        if len(ahead) == len(self.rows):
            return self.tokens_t
        fed = {id(s.seq) for s in ahead}
        keep = [i for i, s in enumerate(self.rows) if id(s.seq) in fed]
        assert len(keep) == len(ahead), "the step queued ahead feeds requests of this one"
        index = torch.tensor(keep, dtype=torch.int64)
        if self.tokens_t.is_cuda:  # pinned: the copy is queued, the host does not wait for it
            index = index.pin_memory().to(self.tokens_t.device, non_blocking=True)
        return self.tokens_t.index_select(0, index.to(self.tokens_t.device))

    def routing_host(self) -> torch.Tensor | None:
        return self._host[2]
