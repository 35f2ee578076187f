"""The quantized GEMM as an autograd function, with the three backward modes (docs/design.md §2, §7).

Legend: x [T, K] activations (T tokens), w [N, K] master weight, y [T, N] = x w^T.

Forward (exact emulation of a block-scaled GEMM):
  y = fl( (lp(Qa(x)) @ lp(Qw(w))^T)_fp32  *  fl(s_x * s_w) )
where lp(.) is the dequantized operand *without* NVFP4's FP32 global scale (e2m1 * s_block and
e4m3 * 2^k products are exact in fp32) and s_x [T, 1], s_w (scalar or [1, N]) the decode global
scales (1 for formats without one). This is the native GEMM up to summation order.

Backward, by mode (the operands through the table in `mxrl.nn.operands`):
  high_precision  dx = dy @ w              dw = dy^T @ x          (the original operands)
  dequantized     dx = dy @ deq(Qw(w))     dw = dy^T @ deq(Qa(x)) (what the forward really used)
  quantized       dx = deq(Qrow(dy)) @ deq(Qcol(w))
  (MXFP8,         dw = deq(Qcol(dy))^T @ deq(Qcol(x))
   block FP8)     Qcol blocks run along the GEMM's reduction dim (N for dx, T for dw); the
                  column-wise copies of w and x are quantized from the high-precision tensors,
                  never from the row-wise copies. T is zero-padded to a whole block (32 MXFP8,
                  b = 128 block FP8) for the column-wise copies (zeros change no block amax and
                  add nothing to the product).
                  MXFP8: 1x32 / 32x1 blocks; on triton both copies of dy come from one read
                  (`quantize_mxfp8_both`).
                  Block FP8 (DeepSeek-V3's FP8 backward): Qrow(dy) in 1 x b blocks along N
                  (a partial last block where N is not a multiple of b, as w's row-blocks);
                  Qcol(w) is the forward's b x b weight copy itself (a square block of w^T holds
                  the elements of a block of w: same scale, same codes); Qcol(dy), Qcol(x) are
                  dy^T, x^T quantized in 1 x b blocks along T (b x 1 blocks of dy and x).
                  dy, x (and w, in `qlinear.path_weight`) are quantized on the forward's backend.
All GEMMs accumulate in fp32; gradients pass straight through the quantizer to the master weight.
Every backend quantizes to the same bytes, so the backend never changes a gradient.
"""

from __future__ import annotations

import functools

import torch

from mxrl.formats import QTensor, decode_global_scale, dequantize
from mxrl.formats.constants import MXFP8_BLOCK, Format
from mxrl.kernels import Backend, Gemm, quantize_mxfp8_both
from mxrl.kernels import quantize as kernel_quantize
from mxrl.kernels.emulated import emulated_gemm
from mxrl.nn.operands import BackwardOperands, Form, GemmKind, Operand, form_of
from mxrl.nn.weight import QWeight
from mxrl.recipe import Backward, TensorSpec
from mxrl.recipe.quantize import activation_quantizer_kwargs

F32 = torch.float32


def output_scale(s_dec_w: torch.Tensor | None) -> torch.Tensor | None:
    """A 2-D weight's decode global scale shaped to multiply the output [T, N]: [] stays a
    scalar, a per-row [N, 1] becomes [1, N]."""
    if s_dec_w is None or s_dec_w.dim() == 0:
        return s_dec_w
    return s_dec_w.reshape(1, -1)


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-t.shape[0]) % multiple
    return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t


def _mxfp8_col(t: torch.Tensor, backend: Backend) -> torch.Tensor:
    """deq of the 32x1 (column-wise) MXFP8 copy of a 2-D tensor, rows zero-padded to 32 (the
    quantizers take whole blocks only)."""
    rows = t.shape[0]
    padded = _pad_rows(t, MXFP8_BLOCK)
    return dequantize(kernel_quantize(padded, Format.MXFP8, axis=0, backend=backend))[:rows]


def _mxfp8_row_and_col(t: torch.Tensor, backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
    """deq of the 1x32 (row-wise) and 32x1 (column-wise) MXFP8 copies of a 2-D tensor, each
    from t, rows zero-padded to 32 as in `_mxfp8_col` (padding rows are blocks of their own in
    the row-wise copy, so the kept rows' bytes are those of the unpadded tensor)."""
    rows = t.shape[0]
    row, col = quantize_mxfp8_both(_pad_rows(t, MXFP8_BLOCK), backend=backend)
    return dequantize(row)[:rows], dequantize(col)[:rows]


def fp8_block_row(t: torch.Tensor, spec: TensorSpec, backend: Backend) -> QTensor:
    """Block FP8 of a 2-D tensor in 1 x b blocks along its last dim (dy's copy for dgrad),
    that dim zero-padded to a whole block (a partial last block, as the weight's own partial
    row-block: zeros change no amax); the caller keeps the first t.shape[1] columns."""
    b = spec.block[1]
    pad = (-t.shape[1]) % b
    t = torch.nn.functional.pad(t, (0, pad)) if pad else t
    return kernel_quantize(t, Format.FP8_BLOCK, block=(1, b), backend=backend)


def fp8_block_col(t: torch.Tensor, spec: TensorSpec, backend: Backend) -> QTensor:
    """Block FP8 of t^T [C, rows padded to b] in 1 x b blocks along the tokens (the b x 1
    blocks of t [rows, C], rows zero-padded to a whole block): dy's and x's copies for wgrad."""
    b = spec.block[1]
    t_pad = _pad_rows(t, b)
    return kernel_quantize(t_pad.t().contiguous(), Format.FP8_BLOCK, block=(1, b), backend=backend)


def emulated_matmul(
    x: torch.Tensor, wq: QWeight, spec: TensorSpec, backend: Backend = Backend.REFERENCE
):
    """The forward GEMM (module docstring): y [T, N] fp32 and the activation's QTensor.
    Shared by the trainer's QMatmul and the rollout engine, so both compute the same thing;
    the activation is quantized on `backend` (chosen once by the caller; same bytes on any)."""
    xq = kernel_quantize(
        x.detach(), spec.format, **activation_quantizer_kwargs(spec), backend=backend
    )
    s_x = decode_global_scale(xq)  # [T, 1] per token, [] per tensor, None
    s_w = output_scale(wq.s_dec)  # [] or [1, N], None
    lp_w = wq.operand(Form.LP, F32)
    return emulated_gemm(dequantize(xq, global_scale=False), lp_w, s_x, s_w), xq


class QMatmul(torch.autograd.Function):
    """y = Qa(x) (x) Qw(w) with the backward of `mode`. `w` is the master weight (a Parameter or
    a view of one: gradients accumulate into it); `wq` its cached quantization."""

    @staticmethod
    def forward(ctx, x, w, wq: QWeight, spec: TensorSpec, mode: Backward, backend):
        y, xq = emulated_matmul(x, wq, spec, backend)
        ctx.mode, ctx.wq, ctx.x_dtype, ctx.w_dtype = mode, wq, x.dtype, w.dtype
        ctx.spec, ctx.backend = spec, backend  # the quantized backward quantizes dy and x too
        # the dequantized backward's WGRAD reads the forward's activation operand, not x
        x_deq = form_of(mode, GemmKind.WGRAD, Operand.FWD_INPUT) is Form.DEQ
        ctx.save_for_backward(dequantize(xq) if x_deq else x, w)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x_saved, w = ctx.saved_tensors
        ops = BackwardOperands(ctx.mode, _reference_operands(ctx, dy, x_saved, w))
        (dy_op, w_op), (dyt_op, x_op) = ops.of(GemmKind.DGRAD), ops.of(GemmKind.WGRAD)
        dx = dy_op @ w_op if ctx.needs_input_grad[0] else None
        dw = dyt_op.t() @ x_op if ctx.needs_input_grad[1] else None
        dx = None if dx is None else dx.to(ctx.x_dtype)
        dw = None if dw is None else dw.to(ctx.w_dtype)
        return dx, dw, None, None, None, None


def _reference_operands(ctx, dy: torch.Tensor, x_saved: torch.Tensor, w: torch.Tensor) -> dict:
    """QMatmul's makers of each (operand, form) (`mxrl.nn.operands`): fp32, in the tensors' own
    layouts (dy [T, N], w [N, K], x [T, K]). x_saved is x, or deq(Qa(x)) where the WGRAD reads
    that (QMatmul.forward). Both GEMMs' operands are made before either runs."""
    wq: QWeight = ctx.wq
    spec, backend = ctx.spec, ctx.backend
    rows, n = dy.shape
    makers = {
        (Operand.BWD_GRAD, Form.HP): dy.float,
        (Operand.FWD_WEIGHT, Form.HP): w.float,
        (Operand.FWD_INPUT, Form.HP): x_saved.float,
        (Operand.FWD_WEIGHT, Form.DEQ): lambda: wq.operand(Form.DEQ, F32),
        (Operand.FWD_INPUT, Form.DEQ): lambda: x_saved,
    }
    if spec.format is Format.FP8_BLOCK:

        def dy_row() -> torch.Tensor:  # dy in 1 x b blocks along N
            return dequantize(fp8_block_row(dy, spec, backend))[:, :n]

        def col(t: torch.Tensor) -> torch.Tensor:  # t^T in 1 x b blocks, back in t's layout
            return dequantize(fp8_block_col(t, spec, backend))[:, :rows].t()

        return makers | {
            (Operand.BWD_GRAD, Form.ROW): dy_row,
            (Operand.BWD_GRAD, Form.COL): lambda: col(dy),
            # the square blocks of w^T are w's (module docstring)
            (Operand.FWD_WEIGHT, Form.COL): lambda: wq.operand(Form.DEQ, F32),
            (Operand.FWD_INPUT, Form.COL): lambda: col(x_saved),
        }
    # MXFP8; dy and x in their own dtype: the quantizers read fp32, bf16 and fp16 exactly
    dy_row_and_col = functools.cache(lambda: _mxfp8_row_and_col(dy, backend))
    return makers | {
        (Operand.BWD_GRAD, Form.ROW): lambda: dy_row_and_col()[0],
        (Operand.BWD_GRAD, Form.COL): lambda: dy_row_and_col()[1],
        (Operand.FWD_WEIGHT, Form.COL): lambda: wq.operand(Form.COL, F32),
        (Operand.FWD_INPUT, Form.COL): lambda: _mxfp8_col(x_saved, backend),
    }


class FunctionPath:
    """A trainer path whose `linear` is one autograd Function (`function`): y [T, N] in x's
    dtype for x [T, K] on the path's QWeight `w`, gradients into `master`. `ReferencePath` and
    `TensorCorePath` (`paths/grouped.py`) are two."""

    autograd = True
    function: type[torch.autograd.Function]

    def linear(
        self,
        x: torch.Tensor,
        w: QWeight,
        master: torch.Tensor,
        spec: TensorSpec,
        mode: Backward,
        backend: Backend,
    ) -> torch.Tensor:
        return self.function.apply(x, master, w, spec, mode, backend)


class ReferencePath(FunctionPath):
    """The reference GEMM path (`Gemm.REFERENCE`; a `mxrl.nn.paths.GemmPath`): `QMatmul`'s
    fp32 emulated GEMMs on the reference's QWeight (its fp32 operands held), the CPU default
    and the test oracle."""

    gemm = Gemm.REFERENCE
    function = QMatmul

    def experts(self, x_TH, ids_Tk, weights_Tk, experts) -> torch.Tensor:
        """The routed experts' output [T, H], one expert at a time (`experts.loop`:
        `mxrl.nn.moe.moe_loop`; a quantized projection's GEMM is this path's `linear` on
        the expert's slice of the weight)."""
        return experts.loop(x_TH, ids_Tk, weights_Tk)

    def __repr__(self) -> str:
        return "ReferencePath()"
