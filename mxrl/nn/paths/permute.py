"""The routed experts' rows sorted by expert and put back (`ExpertLayout`), with autograd, for the
grouped GEMMs of mxrl.nn.paths.grouped.

Legend: T tokens, k experts per token, R = T*k (token, slot) rows, H hidden, E experts.

The R rows are sorted by expert (a stable sort, as the loop's); expert e owns rows
starts[e]:ends[e]. Every sum over a token's k slots adds them in slot order into an fp32
accumulator from +0 (mxrl.kernels.moe_train: the references fix the bytes, on every device).
With `fused` (the model's row-wise kernels are Triton: `GroupedExperts.rowwise`), the gather's
backward and the combine forward and backward are one Triton launch each, the same bytes but
the routing weights' gradient, which is within that module's stated bound.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from mxrl.formats.constants import MXFP8_BLOCK
from mxrl.kernels import moe_train


@dataclass(frozen=True)
class ExpertLayout:
    """The R = T*k assignments sorted by expert, on the device.

    order [R]: sorted row -> flat (token * k + slot) index; inverse [R]: its inverse;
    token_of [R]: each sorted row's token; row_expert [R]: its expert;
    ends [E] int32: each expert's end row (torch._grouped_mm's offsets);
    rows_dtype: the gathered rows' dtype when the first projection reads them in it (bf16
    experts read bf16 rows: x [T, H] is cast before the gather, not its k copies after), None
    for x's own; fused: the Triton kernels (module docstring); gate_up_tokens: the gate/up
    projection takes x's tokens and gathers its own operand rows (row-wise quantized
    activations, `mxrl.nn.paths.grouped.GroupedLinear`'s `tokens`), so nothing gathers x."""

    order: torch.Tensor
    inverse: torch.Tensor
    token_of: torch.Tensor
    row_expert: torch.Tensor
    ends: torch.Tensor
    top_k: int
    rows_dtype: torch.dtype | None = None
    fused: bool = False
    gate_up_tokens: bool = False
    padded_by_block: dict[int, PaddedLayout] = field(default_factory=dict, compare=False)

    @classmethod
    def build(
        cls,
        ids_Tk: torch.Tensor,
        num_experts: int,
        rows_dtype: torch.dtype | None = None,
        fused: bool = False,
        *,
        gate_up_tokens: bool = False,
    ) -> ExpertLayout:
        k = ids_Tk.shape[1]
        flat = ids_Tk.reshape(-1)
        order = torch.argsort(flat, stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        row_expert = flat[order]
        # each expert's end row, without a host sync (CUDA bincount reads the max back)
        experts = torch.arange(num_experts, device=flat.device, dtype=flat.dtype)
        ends = torch.searchsorted(row_expert, experts, right=True).to(torch.int32)
        return cls(
            order, inverse, order // k, row_expert, ends, k, rows_dtype, fused, gate_up_tokens
        )

    def offsets(self) -> torch.Tensor:
        """int32 [E + 1]: 0 and each expert's end row (the block-FP8 kernels' offsets)."""
        return torch.cat([self.ends.new_zeros(1), self.ends])

    def padded(self, block: int = MXFP8_BLOCK) -> PaddedLayout:
        """These rows moved to `block`-aligned starts per expert (`PaddedLayout`), built once
        per block size: the layer's gate/up and down projections share it (and its `src`)."""
        if block not in self.padded_by_block:
            self.padded_by_block[block] = PaddedLayout.build(self, block)
        return self.padded_by_block[block]

    def gather(self, x_TH: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> its rows sorted by expert [R, H] (`mxrl.nn.moe.Dispatch`), in
        `rows_dtype` where given, with autograd: the backward sums each token's k rows in slot
        order, in x's dtype."""
        return _GatherTokens.apply(x_TH, self)

    def sum_rows(self, g_RH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, H] in `dtype`: each token's k rows of g, each in `dtype` (bf16 widened exactly),
        summed in slot order in fp32 (`moe_train.permute_backward_reference`; one launch on
        the fused kernels): the gradient of a gather of x's rows."""
        if self.fused and moe_train.permute_backward_fits(g_RH, dtype):
            return moe_train.permute_backward(g_RH, self.inverse, self.top_k, dtype)
        return moe_train.permute_backward_reference(g_RH, self.inverse, self.top_k, dtype)

    def combine(self, h_RH: torch.Tensor, weights_Tk: torch.Tensor) -> torch.Tensor:
        """Each token's k rows of h times their weights (in h's dtype), summed in slot order
        (no atomics: deterministic), in h's dtype, with autograd."""
        return _Unpermute.apply(h_RH, weights_Tk.to(h_RH.dtype), self)


class _GatherTokens(torch.autograd.Function):
    """x [T, H] -> x_sorted [R, H] (in the layout's `rows_dtype`); the backward sums each
    token's k rows in x's dtype (`moe_train.permute_backward_reference`: bf16 rows widened
    first, exact; fp32 sums in slot order)."""

    @staticmethod
    def forward(ctx, x, layout: ExpertLayout):
        ctx.layout, ctx.x_dtype = layout, x.dtype
        rows = layout.rows_dtype
        return (x if rows is None else x.to(rows)).index_select(0, layout.token_of)

    @staticmethod
    def backward(ctx, g):
        return ctx.layout.sum_rows(g, ctx.x_dtype), None


class _Unpermute(torch.autograd.Function):
    """h [R, H], w [T, k] in h's dtype -> [T, H] (`moe_train.unpermute_reference`); the
    backward gives h's and w's gradients (`moe_train.unpermute_backward_reference`)."""

    @staticmethod
    def forward(ctx, h, w, layout: ExpertLayout):
        ctx.layout = layout
        ctx.save_for_backward(h, w)
        ctx.fused = layout.fused and moe_train.unpermute_fits(h, w)
        run = moe_train.unpermute if ctx.fused else moe_train.unpermute_reference
        return run(h, w, layout.inverse)

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        run = moe_train.unpermute_backward if ctx.fused else moe_train.unpermute_backward_reference
        g_h, g_w = run(g, h, w, ctx.layout.inverse)
        return g_h, g_w, None


@dataclass(frozen=True)
class PaddedLayout:
    """Each expert's rows moved to a block-aligned start (32 MXFP8, 128 block FP8), zero rows
    between (quantized backward). dest [R]: padded row of each sorted row; ends [E] int32;
    rows P (static: R + (b - 1) E, rounded up to b, whatever the routing)."""

    dest: torch.Tensor
    ends: torch.Tensor
    rows: int

    @classmethod
    def build(cls, layout: ExpertLayout, block: int = MXFP8_BLOCK) -> PaddedLayout:
        ends = layout.ends.long()
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        padded_counts = (counts + block - 1) // block * block
        padded_ends = torch.cumsum(padded_counts, 0)
        shift = (padded_ends - padded_counts) - (ends - counts)
        r = layout.order.numel()
        dest = torch.arange(r, device=ends.device) + shift[layout.row_expert]
        rows = r + (block - 1) * ends.numel()
        rows += (-rows) % block
        return cls(dest, padded_ends.to(torch.int32), rows)

    @functools.cached_property
    def src(self) -> torch.Tensor:
        """int32 [P]: the sorted row each padded row holds, -1 for the zero rows (the gather
        `mxrl.kernels.quantize_mxfp8_padded` reads x's rows by)."""
        src = torch.full((self.rows,), -1, dtype=torch.int32, device=self.dest.device)
        rows = torch.arange(self.dest.numel(), dtype=torch.int32, device=self.dest.device)
        return src.index_copy_(0, self.dest, rows)

    def offsets(self) -> torch.Tensor:
        """int32 [E + 1]: 0 and each expert's padded end (the grouped kernels' offsets)."""
        return torch.cat([self.ends.new_zeros(1), self.ends])

    def scatter(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros((self.rows, t.shape[1]))
        return out.index_copy_(0, self.dest, t)
