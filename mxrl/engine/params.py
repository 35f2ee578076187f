"""Requests and results of the rollout engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mxrl.engine.block_manager import BlockManager


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature 0 is greedy (its logprobs are those of the unscaled distribution); top_k 0 and
    top_p 1.0 disable those filters. `seed` makes a request reproducible: with one SamplingParams
    for a whole batch, request i uses seed + i; pass a list (one per prompt) to pin each seed.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    """One request's result.

    tokens: the generated token ids (stop token included when one ended the request).
    logprobs: float32 [len(tokens)], each the processed logprob of its token under the
      distribution actually sampled from (temperature, top-k, top-p applied).
    routed_experts: int64 [num_moe_layers, len(prompt) + len(tokens) - 1, k], the experts each
      token fed through the model was routed to (the last sampled token is never fed), in the
      order of the model's MoE layers; None for a dense model. Routing replay uses it.
    finish_reason: "stop" (a stop token) or "length" (max_new_tokens).
    """

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    routed_experts: torch.Tensor | None = None
    finish_reason: str = "length"


@dataclass
class GenerateStats:
    """What the last `generate` did: steps (of which replayed as CUDA graphs), the most KV
    blocks held at once and the tokens the step's sequences held then (their ratio is the
    paging overhead; prefix sharing can take it below one block per block_size tokens), and the
    wall time, sequences and keys read of every decode step."""

    steps: int = 0
    graph_steps: int = 0
    ahead_steps: int = 0  # decode steps queued before the step before them was read (overlap)
    ahead_rows_dropped: int = 0  # rows of those whose request stopped in the step before
    peak_kv_blocks: int = 0
    peak_kv_tokens: int = 0
    block_size: int = 0
    # wall time of every decode-only step: from its scheduling, or from the read of the step
    # before when it was queued ahead (overlapped decoding), to its sampled tokens on the host
    decode_step_s: list[float] = field(default_factory=list)
    # of each of those steps: the sequences it decoded, and the keys its attention read per
    # layer (every sequence's cached tokens and its own)
    decode_step_rows: list[int] = field(default_factory=list)
    decode_step_keys: list[int] = field(default_factory=list)

    def observe(self, batch, blocks: BlockManager) -> None:
        self.steps += 1
        self.block_size = blocks.block_size
        used = blocks.num_blocks - blocks.num_free
        if used > self.peak_kv_blocks:
            self.peak_kv_blocks = used
            self.peak_kv_tokens = sum(s.start + s.num_tokens for s in batch)

    def decode(self, batch, seconds: float) -> None:
        """One decode-only step done (every sequence fed one token) in `seconds`."""
        self.decode_step_s.append(seconds)
        self.decode_step_rows.append(len(batch))
        self.decode_step_keys.append(sum(s.start + 1 for s in batch))


def per_request(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        if params.seed is None:
            return [params] * n
        from dataclasses import replace

        return [replace(params, seed=params.seed + i) for i in range(n)]
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
    return params


def resolve_seed(seed: int | None) -> int:
    """A request's seed; None draws one from torch's default CPU generator (so
    `torch.manual_seed` makes unseeded runs repeatable too)."""
    if seed is None:
        return int(torch.randint(0, 2**62, ()))
    return int(seed) % (1 << 63)
