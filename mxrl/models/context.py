"""The forward context: how the rollout engine runs the model's own modules over a ragged batch.

The trainer calls the model with padded `[B, S]` batches and no context. The engine flattens a
step's new tokens of every request into one row `[1, T]` (no padding) and sets a
`ForwardContext` around the call, as nano-vllm's layers read theirs: positions for RoPE, and an
attention backend that writes the new keys/values into its (paged) KV cache and attends each
request to exactly its own cached keys. Everything else — norms, projections, router, experts,
the shared expert — runs unchanged on the flat `[1, T, H]` tensor: the engine's weight holders
(module swaps) do the GEMMs.

    with forward_context(ForwardContext(positions, attention)):
        hidden, routing = model.model(ids[None], position_ids=positions[None])

Legend: T new tokens of all requests, N / K query / key-value heads, D head dim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


class RaggedAttention(Protocol):
    """What `Attention.forward` calls under a context (the engine's paged KV cache)."""

    def __call__(
        self,
        layer_idx: int,
        q_NTD: torch.Tensor,
        k_KTD: torch.Tensor,
        v_KTD: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Store this step's keys/values (after RoPE) of layer `layer_idx`, then return the
        attention output [N, T, Dv] of every new token over its own request's keys (causal).
        scale: the softmax scale (None: 1/sqrt(D); MLA's: 1/sqrt(qk head dim) times yarn's
        mscale^2, with values of another width Dv)."""
        ...


@dataclass(frozen=True)
class ForwardContext:
    """positions: int64 [T], the absolute position of every new token. attention: the backend
    for the ragged batch (it owns the request boundaries, slots and block tables)."""

    positions: torch.Tensor
    attention: RaggedAttention


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext | None:
    """The context of the forward in progress, or None (the trainer's padded batches)."""
    return _CONTEXT


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Set `ctx` for the model calls inside the block (not re-entrant: one forward at a time)."""
    global _CONTEXT
    if _CONTEXT is not None:
        raise RuntimeError("a forward context is already set: one engine forward at a time")
    _CONTEXT = ctx
    try:
        yield ctx
    finally:
        _CONTEXT = None
