"""One request as the scheduler sees it: its tokens, its KV blocks, what is computed so far."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mxrl.engine.params import SamplingParams

if TYPE_CHECKING:
    from mxrl.engine.block_manager import BlockManager


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its KV blocks freed)
    RUNNING = "running"  # holds KV blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass
class Sequence:
    """index: the request's position in `Engine.generate`'s list. tokens: prompt then the
    generated tokens. num_computed: how many of `tokens` have their keys/values in the cache
    (prefix-cache hits count). block_table: the cache blocks holding tokens 0, B, 2B, ...
    routing: per MoE layer, the experts of each token fed so far (int64 [num_fed, k] pieces).
    """

    index: int
    prompt: list[int]
    params: SamplingParams
    seed: int  # the request's sampling noise is a hash of (seed, tokens generated so far)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str = "length"
    routing: list[torch.Tensor] = field(default_factory=list)  # [positions fed, layers, k] parts
    num_routed: int = 0  # positions whose routing is recorded (a recomputed one is not again)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks (block_manager)
    num_registered: int = 0  # leading blocks of block_table already registered for sharing

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    def __len__(self) -> int:
        return len(self.tokens)

    def record_routing(self, start: int, routed: torch.Tensor, blocks: BlockManager) -> None:
        """Keep the experts of the positions fed from `start` (`routed` [n, layers, k]) not
        recorded yet (a recomputed one is the same); positions before `start` not recorded
        came from the prefix cache: their blocks' routing, as their computer recorded it."""
        if start > self.num_routed:
            bs = blocks.block_size
            for index in range(self.num_routed // bs, start // bs):
                part = blocks.routing[self.block_table[index]]
                self.routing.append(
                    part[self.num_routed - index * bs :]
                )  # a part-recorded block: its rest
                self.num_routed = (index + 1) * bs
            self.num_routed = start
        skip = self.num_routed - start  # >= 0 here: positions recomputed after a preemption
        if skip < routed.shape[0]:
            self.routing.append(routed[skip:] if skip else routed)  # a decode row: no new view
            self.num_routed = start + routed.shape[0]

    def routing_from(self, start: int) -> torch.Tensor:
        """The recorded routing of positions [start, num_routed), [n, layers, k]: only the
        last parts are joined (a block's routing is asked for as it fills; joining every part
        each time was quadratic in the sequence's length), and the joined parts are kept as
        that one part: a decode step records one row a request, so a block's 16 rows become
        one part as it fills and the completion joins a part a block instead of one a token
        (~300k one-row parts after a rollout of 256 requests of ~1,200 tokens)."""
        parts, first = [], self.num_routed
        for part in reversed(self.routing):
            if first <= start:
                break
            parts.append(part)
            first -= part.shape[0]
        if not parts:
            raise ValueError(f"no routing recorded from position {start} (have {self.num_routed})")
        if len(parts) == 1:
            joined = parts[0]
        else:
            joined = torch.cat(parts[::-1])
            del self.routing[-len(parts) :]
            self.routing.append(joined)
        return joined[start - first :]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def max_len(self) -> int:
        """Tokens this request can hold at most: its prompt and every token it may generate
        (the last sampled one is never fed, so its KV needs one slot less)."""
        return len(self.prompt) + self.params.max_new_tokens - 1

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed


def split_routing(routing: torch.Tensor | None, lengths: list[int]) -> list[torch.Tensor]:
    """Per scheduled sequence, its tokens' routing [n, L, k] (empty [n, 0, 0] when dense)."""
    if routing is None:
        return [torch.zeros((n, 0, 0), dtype=torch.int64) for n in lengths]
    return list(routing.split(lengths))
