"""Routed experts as grouped GEMMs (`Gemm.TENSOR_CORE`): no Python loop over experts, no host sync.

Legend: T tokens, k experts per token, R = T*k (token, slot) rows, H hidden, N / K a projection's
output / input features, E experts, P rows of the 32-aligned padded layout.

The R rows are sorted by expert (a stable sort, as the loop's); expert e owns rows
starts[e]:ends[e] (`ExpertLayout`, mxrl.nn.paths.permute: device tensors). Each projection is
one `torch._grouped_mm` (bf16, fp32 accumulation) forward and two backward (dgrad [R, N] @
[E, N, K]; wgrad [N, R] @ [R, K] -> [E, N, K]), in `GroupedLinear`, whose operands follow
docs/nn.md's modes (through the table in `mxrl.nn.operands`):
  bf16 experts    x, w cast to bf16 (w re-cast in the backward: no bf16 weight copy is kept),
                  or, given the held bf16 copy of w (`GroupedExperts.hold_bf16`), that copy in
                  both GEMMs (the same bytes: it is w cast, made once per optimizer step)
  quantized fwd   lp(Qa(x)) and lp(Qw(w)) exact in bf16; the NVFP4 global scales (per token,
                  per expert) multiply the bf16 output rows
  high_precision  dgrad on bf16(w), wgrad on bf16(x)
  dequantized     dgrad on bf16(deq(Qw(w))), wgrad on bf16(deq(Qa(x))) (the saved quantized x)
  quantized       MXFP8, as the loop's: dy and x column-wise copies quantized per expert group,
                  each group padded with zero rows to a multiple of 32 (`PaddedLayout`), so the
                  blocks are the loop's blocks, byte for byte. Block FP8 on FP8 codes end to
                  end: dgrad Qrow(dy) (1x128) times w[e] through the forward's codes read
                  transposed (`grouped_fp8_block_matmul(transpose_w=True)`), wgrad dy^T and x^T
                  quantized 1x128 along the tokens, each expert's rows padded to 128
                  (`grouped_fp8_block_wgrad`, fp32 straight into the master's gradient)
The (token, slot) outputs are put back by a permutation and each token's k outputs summed in
slot order (no atomics: deterministic; one Triton launch where the row-wise kernels are
Triton). Activation quantization is per row (MXFP8 1x32, NVFP4 per token), so sorting the rows
leaves their bytes as the loop's.
"""

from __future__ import annotations

import functools

import torch

from mxrl.formats import QTensor, decode_global_scale
from mxrl.formats.constants import Format
from mxrl.kernels import dequantize as kernel_dequantize
from mxrl.kernels import padded_rows, qdq_mxfp8, quantize_mxfp8_padded, scale_bf16, to_float32
from mxrl.kernels.backend import Backend, Gemm, triton_interpreter_enabled
from mxrl.kernels.fp8_gemm import grouped_fp8_block_matmul, grouped_fp8_block_wgrad
from mxrl.nn.gemm import grouped_mm
from mxrl.nn.moe import moe_grouped
from mxrl.nn.operands import BackwardOperands, Form, GemmKind, Operand, form_of
from mxrl.nn.paths.permute import ExpertLayout, PaddedLayout
from mxrl.nn.paths.reference import FunctionPath, fp8_block_col, fp8_block_row
from mxrl.nn.paths.tensor_core import BF16, TensorCoreQMatmul, quantize_activation
from mxrl.nn.weight import QWeight
from mxrl.recipe import Backward, TensorSpec

GROUPED_FORMATS = (Format.BF16, Format.MXFP8, Format.NVFP4, Format.FP8_BLOCK)
# activation quantization per row (MXFP8 1x32, NVFP4 per token on the grouped path, block FP8
# 1x128): a token's bytes are the same in each of its k rows
ROW_QUANTIZED = (Format.MXFP8, Format.NVFP4, Format.FP8_BLOCK)
# The block-FP8 kernels' tiles in training, the fastest of `benchmarks/fp8_block_grouped.py`'s
# sweep on the H200 at Qwen3-30B-A3B's width (docs/kernels.md). The forward and dgrad keep the
# fp16 MMA on decoded codes (exact products, fp32 sums; the FP8 MMA was faster for the forward,
# but its reduced-precision accumulation would move the trainer's logits away from rollout's);
# the wgrad, a gradient only, runs on the FP8 MMA.
FORWARD_TILE = dict(block_m=128, block_n=128, num_warps=8, num_stages=3)
DGRAD_TILE = dict(block_m=128, block_n=128, num_warps=8, num_stages=4)
WGRAD_TILE = dict(block_n=64, block_k=128, num_warps=4, num_stages=4, fp8_mma=True)


def _row_scale(s_x, s_w, row_expert) -> torch.Tensor | None:
    """fl(s_x * s_w) per output row ([R, 1]) or element ([R, N]); None when both are missing."""
    if s_x is None and s_w is None:
        return None
    one = torch.ones((), device=row_expert.device)
    if s_w is not None and s_w.dim():
        s_w = s_w[row_expert].reshape(row_expert.numel(), -1)  # [E, 1 or N, 1] -> [R, 1 or N]
    return (s_x if s_x is not None else one) * (s_w if s_w is not None else one)


class GroupedLinear(torch.autograd.Function):
    """y [R, N] (bf16) = x [R, K] @ w[e]^T for the rows of expert e; w [E, N, K] the master
    weight. spec None: bf16 experts, tw the held bf16 copy of w or None (cast here); else tw
    holds the quantized weight (module docstring). tokens (row-wise quantized activations:
    MXFP8, per-token NVFP4, 1 x 128 block FP8): x is the T tokens [T, K], each quantized once
    and its operand rows (block FP8: its codes and scales) gathered here (`layout.token_of`),
    and x's gradient is each token's k rows summed
    (`ExpertLayout.sum_rows`): the same bytes as quantizing the gathered rows, without the
    gathered [R, K] copy of x or k quantizations of each token, and the backward keeps the
    tokens' copy of x (HP, DEQ), not the rows'."""

    @staticmethod
    def forward(ctx, x, w, layout: ExpertLayout, tw: QWeight | torch.Tensor | None, spec, mode,
                backend, tokens: bool = False):  # fmt: skip
        ctx.layout, ctx.tw, ctx.mode, ctx.backend, ctx.spec = layout, tw, mode, backend, spec
        ctx.x_dtype, ctx.w_dtype, ctx.tokens = x.dtype, w.dtype, tokens
        if spec is None:
            a = x.to(BF16)
            w_bf16 = tw if tw is not None else w.to(BF16)
            y = grouped_mm(a, w_bf16.transpose(-2, -1), layout.ends)
            ctx.save_for_backward(a, w)  # w: the version check (a write since is refused)
            return y
        x_form = form_of(mode, GemmKind.WGRAD, Operand.FWD_INPUT)
        if spec.format is Format.FP8_BLOCK:  # codes and block scales straight to the kernel
            xq = quantize_activation(x, spec, backend)
            xq_rows = _rows_q(ctx, xq)
            y = grouped_fp8_block_matmul(
                xq_rows, tw.q, layout.offsets(), out_dtype=BF16, **FORWARD_TILE
            )
        else:
            lp_x, xq, s_x = _lp_rows(ctx, x.detach(), spec, x_form, layout, backend)
            y = grouped_mm(lp_x, tw.operand(Form.LP, BF16).transpose(-2, -1), layout.ends)
            scale = _row_scale(s_x, tw.s_dec, layout.row_expert)
            if scale is not None:  # (y.float() * scale).to(BF16) in one pass
                y = scale_bf16(y, scale, backend=backend)
        # what the backward keeps of x: the form its WGRAD reads (of x's T tokens, `tokens`)
        if x_form is Form.HP:
            ctx.save_for_backward(x.to(BF16), w)
        elif x_form is Form.DEQ:
            ctx.xq = xq
            ctx.save_for_backward(w)
        elif spec.format is Format.FP8_BLOCK:
            ctx.padded = layout.padded(spec.block[1])
            ctx.x_col = fp8_block_col(_padded_rows(ctx, x.detach()), spec, backend)
            ctx.save_for_backward(w)
        else:  # MXFP8's column-wise copy, made with the GEMM's operand (`_lp_rows`)
            ctx.save_for_backward(w)
        return y

    @staticmethod
    def backward(ctx, dy):
        lay: ExpertLayout = ctx.layout
        dy = dy.contiguous()
        spec = ctx.spec
        mode = Backward.HIGH_PRECISION if spec is None else ctx.mode  # bf16 experts: x and w
        if mode is Backward.QUANTIZED and spec.format is Format.FP8_BLOCK:
            return _fp8_block_backward(ctx, dy)
        ops = BackwardOperands(mode, _bf16_operands(ctx, dy))
        (dy_op, w_op), (dyt_op, x_op) = ops.of(GemmKind.DGRAD), ops.of(GemmKind.WGRAD)
        # the COL copies hold each expert's rows from a 32-aligned start (zeros add nothing)
        x_col = form_of(mode, GemmKind.WGRAD, Operand.FWD_INPUT) is Form.COL
        wgrad_ends = ctx.padded.ends if x_col else lay.ends
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx_rows = grouped_mm(dy_op, w_op, lay.ends)
            if ctx.tokens:  # each token's k rows, widened (exact) and summed in slot order
                dx = lay.sum_rows(dx_rows, ctx.x_dtype)
            else:
                dx = _widen(dx_rows, ctx.x_dtype, ctx.backend)
        if ctx.needs_input_grad[1]:
            dw = _widen(grouped_mm(dyt_op.t(), x_op, wgrad_ends), ctx.w_dtype, ctx.backend)
        return dx, dw, None, None, None, None, None, None


def _bf16_operands(ctx, dy: torch.Tensor) -> dict:
    """GroupedLinear's makers of each (operand, form) (`mxrl.nn.operands`) but block FP8's
    quantized ones: bf16, in the tensors' own layouts (dy [R, N], w [E, N, K], x [R, K]), the
    quantized backward's COL copies of dy and x in the padded layout (`PaddedLayout`). Saved:
    (bf16 x, w) where the WGRAD reads x itself, else (w,). Both GEMMs' operands are made before
    either runs."""
    tw: QWeight | None = ctx.tw
    backend = ctx.backend
    # read only where a form needs x or w: reading checks their versions, and a weight
    # written since the forward must be refused by the column-wise copy's own message
    saved = functools.cache(lambda: ctx.saved_tensors)

    @functools.cache
    def dy_row_and_col():  # MXFP8: both copies of dy from one read (the column-wise padded)
        assert tw is not None, "quantized backward needs the quantized weight"
        return quantize_mxfp8_padded(dy, ctx.padded.src, col_qdq=True, backend=backend)

    return {
        (Operand.BWD_GRAD, Form.HP): lambda: dy.to(BF16),
        (Operand.FWD_WEIGHT, Form.HP): lambda: _hp_weight(ctx, saved()),
        (Operand.FWD_INPUT, Form.HP): lambda: _rows(ctx, saved()[0]),
        (Operand.FWD_WEIGHT, Form.DEQ): lambda: tw.operand(Form.DEQ, BF16),
        (Operand.FWD_INPUT, Form.DEQ): lambda: _rows(
            ctx, kernel_dequantize(ctx.xq, backend=backend)
        ),
        (Operand.BWD_GRAD, Form.ROW): lambda: dy_row_and_col()[0],
        (Operand.BWD_GRAD, Form.COL): lambda: dy_row_and_col()[1],
        (Operand.FWD_WEIGHT, Form.COL): lambda: tw.operand(Form.COL, BF16),
        (Operand.FWD_INPUT, Form.COL): lambda: kernel_dequantize(ctx.x_col, backend=backend),
    }


def _lp_rows(ctx, x, spec: TensorSpec, x_form: Form, layout: ExpertLayout, backend) -> tuple:
    """The forward GEMM's activation operand of MXFP8 and NVFP4 projections, bf16 [R, K] (the
    rows of x, or of x's tokens gathered: `ctx.tokens`), with what the backward keeps of it:
    (lp, xq, s_x): xq the QTensor a DEQ wgrad dequantizes (None where nothing keeps codes),
    s_x the per-row NVFP4 global scales (None for MXFP8). MXFP8's quantized backward also
    gets its padded column-wise codes (`ctx.padded`, `ctx.x_col`) from the same read."""
    if spec.format is Format.MXFP8 and x_form is Form.COL:
        ctx.padded = layout.padded()
        if not ctx.tokens:
            lp, ctx.x_col = quantize_mxfp8_padded(x, ctx.padded.src, backend=backend)
            return lp, None, None
        # each token read in k padded rows: the row-wise copy apart, once per token
        gather = _padded_tokens(ctx)
        _, ctx.x_col = quantize_mxfp8_padded(x, gather, rowwise=False, backend=backend)
        return _rows(ctx, qdq_mxfp8(x, backend=backend)[0]), None, None
    if spec.format is Format.MXFP8 and x_form is not Form.DEQ:
        # only the GEMM reads Qa(x): its bf16 values in one pass, no codes kept
        return _rows(ctx, qdq_mxfp8(x, backend=backend)[0]), None, None
    xq = quantize_activation(x, spec, backend)
    lp = kernel_dequantize(xq, global_scale=False, backend=backend)
    s_x = decode_global_scale(xq)
    return _rows(ctx, lp), xq, None if s_x is None else _rows(ctx, s_x)


def _padded_tokens(ctx) -> torch.Tensor:
    """int32 [P]: the token each row of `ctx.padded` holds, -1 for its zero rows."""
    src = ctx.padded.src
    return torch.where(src >= 0, ctx.layout.token_of.int()[src.clamp(min=0)], -1)


def _padded_rows(ctx, x: torch.Tensor) -> torch.Tensor:
    """x's rows in `ctx.padded`'s layout, zeros between experts: scattered from the sorted
    rows, or gathered from x's tokens (`ctx.tokens`; the same tensor)."""
    if not ctx.tokens:
        return ctx.padded.scatter(x)
    return padded_rows(x, _padded_tokens(ctx))


def _rows_q(ctx, q: QTensor) -> QTensor:
    """A row-wise (1 x b) QTensor's rows in the sorted layout, codes and scales gathered from
    x's tokens where GroupedLinear took them (`ctx.tokens`), else q itself."""
    if not ctx.tokens:
        return q
    idx = ctx.layout.token_of
    shape = (idx.numel(), *q.shape[1:])
    return QTensor(q.qdata.index_select(0, idx), q.scale.index_select(0, idx), q.fmt, shape)


def _rows(ctx, t: torch.Tensor) -> torch.Tensor:
    """t's rows in the sorted layout: gathered from x's tokens where GroupedLinear took them
    (`ctx.tokens`), else t itself."""
    return t.index_select(0, ctx.layout.token_of) if ctx.tokens else t


def _hp_weight(ctx, saved: tuple) -> torch.Tensor:
    """The dgrad's bf16 weight: bf16 experts' held copy (`ctx.tw`) where given, a quantized
    weight's `master_operand` (kept per optimizer step where it keeps HP: `hold_bf16`), else
    the saved master cast again; after `saved`, which refuses a weight written since the
    forward."""
    if ctx.spec is None and ctx.tw is not None:
        return ctx.tw
    if isinstance(ctx.tw, QWeight):
        return ctx.tw.master_operand(saved[-1], BF16)
    return saved[-1].to(BF16)


def _fp8_block_backward(ctx, dy: torch.Tensor) -> tuple:
    """GroupedLinear's block-FP8 quantized backward (module docstring), on FP8 codes: dgrad
    through the forward kernel on w's codes transposed, wgrad grouped along the tokens (FP8
    MMA). Its operands are QTensors, each made only where its GEMM runs: COL of w is the
    forward's square blocks, which the dgrad kernel reads transposed; COL of dy and x are
    dy^T and x^T in the padded layout."""
    lay: ExpertLayout = ctx.layout
    pad: PaddedLayout = ctx.padded
    spec, tw, backend = ctx.spec, ctx.tw, ctx.backend
    ops = BackwardOperands(
        Backward.QUANTIZED,
        {
            (Operand.BWD_GRAD, Form.ROW): lambda: fp8_block_row(dy, spec, backend),
            (Operand.BWD_GRAD, Form.COL): lambda: fp8_block_col(pad.scatter(dy), spec, backend),
            (Operand.FWD_WEIGHT, Form.COL): lambda: tw.q,
            (Operand.FWD_INPUT, Form.COL): lambda: ctx.x_col,
        },
    )
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dyq, wq = ops.of(GemmKind.DGRAD)
        dx = grouped_fp8_block_matmul(
            dyq, wq, lay.offsets(), out_dtype=BF16, transpose_w=True, **DGRAD_TILE
        )
        dx = lay.sum_rows(dx, ctx.x_dtype) if ctx.tokens else dx.to(ctx.x_dtype)
    if ctx.needs_input_grad[1]:
        dy_col, x_col = ops.of(GemmKind.WGRAD)
        dw = grouped_fp8_block_wgrad(dy_col, x_col, pad.offsets(), **WGRAD_TILE)
        dw = dw.to(ctx.w_dtype)
    return dx, dw, None, None, None, None, None, None


def _widen(t_bf16: torch.Tensor, dtype: torch.dtype, backend) -> torch.Tensor:
    """A grouped GEMM's bf16 output in the gradient's dtype: to fp32 (an fp32 master's weight
    gradient, the largest tensors of the step) by the copy-speed kernel on the triton backend."""
    if dtype == torch.float32:
        return to_float32(t_bf16, backend=backend)
    return t_bf16.to(dtype)


def grouped_experts_forward(experts, x_TH, ids_Tk, weights_Tk) -> torch.Tensor:
    """GroupedExperts' result in the grouped form (`mxrl.nn.moe.moe_grouped`), each projection
    `experts._grouped_proj`, combined in slot order (`ExpertLayout`)."""
    # bf16 gate/up weights read x's rows in bf16: gather them so (GroupedLinear casts them
    # first thing anyway, so the same bytes), not an fp32 [R, H] copy cast after
    gate_up = experts._grouped_specs()["gate_up"]
    fused = experts.rowwise is Backend.TRITON  # the permutation's kernels (nn.paths.permute)
    rows = BF16 if gate_up is None else None
    # row-wise quantized gate/up weights read Qa(x) per row: each token quantized once and
    # its operand gathered by GroupedLinear (`tokens`), not x's k copies gathered in fp32
    tokens = gate_up is not None and gate_up.format in ROW_QUANTIZED
    layout = ExpertLayout.build(ids_Tk, experts.num_experts, rows, fused, gate_up_tokens=tokens)
    project = functools.partial(_project, experts, layout=layout)
    return moe_grouped(x_TH, weights_Tk, layout, project, gather=not tokens)


def _project(experts, which: str, x_sorted: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    return experts._grouped_proj(which, x_sorted, layout)


def grouped_supported(
    specs: dict[str, TensorSpec | None],
    dims: tuple[int, ...],
    device: torch.device | None = None,
    backward: Backward | None = None,
) -> bool:
    """Whether the grouped path takes these experts: bf16, MXFP8 or per-token NVFP4 projections
    (a per-tensor NVFP4 activation scale would span all experts' rows), block FP8 in 128x128
    weight blocks on a device the Triton kernels run on (`mxrl.kernels.fp8_gemm`; with the
    quantized backward, output features in whole blocks, which its dgrad reads transposed),
    and every feature dim a multiple of 8 (torch._grouped_mm's 16-byte strides)."""
    for spec in specs.values():
        if spec is None:
            continue
        if spec.format not in GROUPED_FORMATS:
            return False
        if spec.format is Format.NVFP4 and spec.activations != "per_token":
            return False
        if spec.format is Format.FP8_BLOCK and not (
            spec.block == (128, 128)
            and backward is not None
            and device is not None
            and (device.type == "cuda" or triton_interpreter_enabled())
            and (backward is not Backward.QUANTIZED or spec.shape[-2] % 128 == 0)
        ):
            return False
    return all(d % 8 == 0 for d in dims)


class TensorCorePath(FunctionPath):
    """The tensor-core GEMM path (`Gemm.TENSOR_CORE`; a `mxrl.nn.paths.GemmPath`):
    `TensorCoreQMatmul` (`tensor_core.py`) on the tensor-core path's QWeight (nothing derived
    held), bf16 tensor cores with fp32 accumulation, block FP8 on `torch._scaled_mm`; routed
    experts as grouped GEMMs (`GroupedLinear`) where their formats and shapes allow, else one
    at a time as the reference. Here, not in `tensor_core.py`: this file imports that one."""

    gemm = Gemm.TENSOR_CORE
    function = TensorCoreQMatmul

    def grouped(
        self,
        x_sorted: torch.Tensor,
        w: QWeight,
        master: torch.Tensor,
        spec: TensorSpec,
        mode: Backward,
        backend: Backend,
        layout: ExpertLayout,
        tokens: bool = False,
    ) -> torch.Tensor:
        """One quantized projection of the routed experts, x_sorted [R, K] (rows sorted by
        expert, `layout`; with `tokens`, x's tokens [T, K], gathered by GroupedLinear) times
        each row's expert of `w` [E, N, K]: `GroupedLinear`, gradients into `master`."""
        return GroupedLinear.apply(x_sorted, master, layout, w, spec, mode, backend, tokens)

    def experts(self, x_TH, ids_Tk, weights_Tk, experts) -> torch.Tensor:
        """The routed experts' output [T, H]: two grouped projections
        (`grouped_experts_forward`, each `experts._grouped_proj`) where `experts.grouped_fits`,
        else the reference's loop (`experts.loop`)."""
        if experts.grouped_fits(x_TH.device):
            return grouped_experts_forward(experts, x_TH, ids_Tk, weights_Tk)
        return experts.loop(x_TH, ids_Tk, weights_Tk)

    def __repr__(self) -> str:
        return "TensorCorePath()"
