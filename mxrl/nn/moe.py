"""The routed experts' dispatch, one for the trainer and the engine (docs/design.md §4.5).

Legend: T tokens, H hidden, k experts per token, R = T*k (token, slot) rows, E experts.

Two forms, each written once:
  loop     `moe_loop`: the assignments sorted by expert (stable), each expert run on its
           tokens, the weighted outputs added back with `index_add_` in ascending expert order;
           one host read (the per-expert counts). The reference path's (`ReferencePath`), and
           the engine's where its experts' GEMMs are emulated.
  grouped  `moe_grouped`: the R rows sorted by expert (`Dispatch.gather`), each projection one
           grouped GEMM over all experts (`project`), SwiGLU between, each token's k outputs
           weighted and summed (`Dispatch.combine`); no host read. The dispatch decides the
           combine order: slot order with autograd in training (`ExpertLayout`,
           mxrl.nn.paths.grouped), ascending expert order in the engine (`ExpertGroups`,
           mxrl.nn.paths.rollout: the loop's `index_add_` order, so the engine's grouped and
           loop forms give the same bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from mxrl.nn import invariant


def moe_loop(
    x_TH: torch.Tensor,
    ids_Tk: torch.Tensor,
    weights_Tk: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The routed experts' loop form, the trainer's reference and the engine's emulated path
    alike: the T*k assignments sorted by expert (stable: token order within an expert), each
    expert run once on its tokens (`expert(e, x_nH) -> h_nH`), its outputs times their routing
    weights (rounded to the output's dtype) added back with `index_add_` in ascending expert
    order. One host read (the per-expert counts)."""
    k = ids_Tk.shape[1]
    flat_ids = ids_Tk.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_of = order // k  # which token each sorted assignment belongs to
    weights = weights_Tk.reshape(-1)[order]
    out = torch.zeros_like(x_TH)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx = token_of[start : start + n]
        h = expert(e, x_TH[idx])
        h = h * weights[start : start + n, None].to(h.dtype)
        out.index_add_(0, idx, h.to(out.dtype))
        start += n
    return out


class Dispatch(Protocol):
    """The R = T*k assignments of a batch sorted by expert (stable), as a grouped GEMM reads
    them: `gather` takes x [T, H] to its rows [R, H] in that order, `combine` each token's k
    rows of h [R, H] times their routing weights ([T, k]) to [T, H], in h's dtype."""

    def gather(self, x_TH: torch.Tensor) -> torch.Tensor: ...

    def combine(self, h_RH: torch.Tensor, weights_Tk: torch.Tensor) -> torch.Tensor: ...


def moe_grouped(
    x_TH: torch.Tensor,
    weights_Tk: torch.Tensor,
    dispatch: Dispatch,
    project: Callable[[str, torch.Tensor], torch.Tensor],
    *,
    gather: bool = True,
) -> torch.Tensor:
    """The routed experts' grouped form: x's rows sorted by expert (`dispatch`), the gate/up
    projection (`project("gate_up", rows)`, one grouped GEMM), SwiGLU, the down projection,
    each token's k outputs combined (`dispatch.combine`); the result in x's dtype. gather
    False: the gate/up projection takes x's tokens and gathers its own rows."""
    x_sorted = dispatch.gather(x_TH) if gather else x_TH
    gate, up = project("gate_up", x_sorted).chunk(2, dim=-1)
    h = project("down", invariant.silu_mul(gate, up))
    return dispatch.combine(h, weights_Tk).to(x_TH.dtype)
