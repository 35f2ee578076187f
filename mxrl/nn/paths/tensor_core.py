"""The tensor-core training GEMMs of a quantized weight (`Gemm.TENSOR_CORE`, docs/nn.md "Fast
paths"): the same quantized bytes as `mxrl.nn.paths.reference`, the GEMMs in bf16 with fp32
accumulation.

Legend: x [T, K] activations, w [N, K] master weight (fp32 or bf16), y [T, N] = x w^T.

Forward: MXFP8 / NVFP4 operands lp(Qa(x)), lp(Qw(w)) are exact in bf16, multiplied with an fp32
output (`mm_f32`), then the global scales as `mxrl.kernels.emulated` applies them: the emulated
GEMM up to the fp32 summation order. Block FP8 (N, K multiples of 128, CUDA): `torch._scaled_mm`
blockwise on FP8 tensor cores (`mxrl.kernels.fp8_gemm`, within its bound); otherwise the fp32
emulated GEMM.
Backward (bf16 operands, fp32 output), by mode (the operands through `mxrl.nn.operands`):
  high_precision  dx = dy @ w           dw = dy^T @ x             (w, x, dy rounded to bf16)
  dequantized     dx = dy @ deq(Qw(w))  dw = dy^T @ deq(Qa(x))    (deq rounded to bf16: exact
                                                                   for MXFP8, not for NVFP4's
                                                                   global scale nor block FP8)
  quantized       MXFP8: as qmatmul, every operand exact in bf16. Block FP8: as qmatmul, on
                  FP8 tensor cores (`torch._scaled_mm` blockwise, fp32 output): dgrad
                  Qrow(dy) [T, N] 1x128 times w^T's square blocks (`col`: the forward's codes
                  transposed once per optimizer step, 1 byte per weight), wgrad dy^T [N, T] and
                  x^T [K, T] quantized 1x128 along the tokens (1x128 x 1x128); off CUDA, or for
                  sizes cuBLAS does not take, the fp32 emulated GEMM of the same operands
Saved for backward: x itself (high precision; the tensor autograd already keeps), the quantized
activation (dequantized mode: 8.25 / 4.5 bits per element instead of a fp32 copy), the column-wise
copy of x (quantized mode: MXFP8 32x1, block FP8 x^T in 1x128, quantized in the forward: the same
bytes, since a quantizer is a pure function of its input).
Held from one optimizer step to the next: the weight's QTensor(s), never a bf16 copy; every bf16
operand is written when its GEMM runs (`mxrl.kernels.dequantize`, or `qdq_mxfp8` straight from x
or dy where no codes are kept), the reference's bytes on either backend.
"""

from __future__ import annotations

import functools

import torch

from mxrl.formats import QTensor, decode_global_scale, dequantize
from mxrl.formats.constants import MXFP8_BLOCK, Format
from mxrl.kernels import Backend, qdq_mxfp8
from mxrl.kernels import dequantize as kernel_dequantize
from mxrl.kernels import quantize as kernel_quantize
from mxrl.kernels.emulated import apply_global_scales, emulated_gemm
from mxrl.nn.gemm import mm_f32
from mxrl.nn.operands import BackwardOperands, Form, GemmKind, Operand, form_of
from mxrl.nn.paths.reference import fp8_block_col, fp8_block_row
from mxrl.nn.weight import QWeight
from mxrl.recipe import Backward, TensorSpec
from mxrl.recipe.quantize import activation_quantizer_kwargs

BF16 = torch.bfloat16
FP8_GEMM_BLOCK = 128


def quantize_activation(x: torch.Tensor, spec: TensorSpec, backend: Backend) -> QTensor:
    return kernel_quantize(
        x.detach(), spec.format, **activation_quantizer_kwargs(spec), backend=backend
    )


def uses_scaled_mm(spec: TensorSpec, device: torch.device) -> bool:
    """Block FP8 on FP8 tensor cores: CUDA, 1x128 / 128x128 blocks, N and K multiples of 128."""
    n, k = spec.shape[-2], spec.shape[-1]
    return (
        spec.format is Format.FP8_BLOCK
        and device.type == "cuda"
        and tuple(spec.block or ()) == (FP8_GEMM_BLOCK, FP8_GEMM_BLOCK)
        and n % FP8_GEMM_BLOCK == 0
        and k % FP8_GEMM_BLOCK == 0
    )


def forward_gemm(xq: QTensor, tw: QWeight, spec: TensorSpec) -> torch.Tensor:
    """fp32 y [T, N] from the quantized activation and weight (module docstring)."""
    if spec.format is Format.FP8_BLOCK:
        if uses_scaled_mm(spec, xq.device):
            from mxrl.kernels.fp8_gemm import fp8_block_matmul

            return fp8_block_matmul(xq, tw.q, out_dtype=torch.float32)
        return emulated_gemm(dequantize(xq), dequantize(tw.q))
    s_w = tw.s_dec
    if s_w is not None and s_w.dim():
        s_w = s_w.reshape(1, -1)  # per-row [N, 1] -> a column scale of the output
    lp_x = kernel_dequantize(xq, global_scale=False, backend=tw.backend)
    return apply_global_scales(
        mm_f32(lp_x, tw.operand(Form.LP, BF16).t()), decode_global_scale(xq), s_w
    )


def pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-t.shape[0]) % multiple
    return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t


def fp8_block_gemm(aq: QTensor, bq: QTensor, spec: TensorSpec) -> torch.Tensor:
    """fp32 a [M, C] @ b [N, C]^T of two block-FP8 QTensors (a 1x128; b 128x128 or 1x128): on
    FP8 tensor cores where `uses_scaled_mm` holds, else the emulated fp32 GEMM."""
    if uses_scaled_mm(spec, aq.device):
        from mxrl.kernels.fp8_gemm import fp8_block_matmul

        return fp8_block_matmul(aq, bq, out_dtype=torch.float32)
    return emulated_gemm(dequantize(aq), dequantize(bq))


def fp8_block_backward(ctx, dy: torch.Tensor):
    """The block-FP8 quantized backward (module docstring): dx and dw in x's and w's dtypes,
    None where not needed. ctx holds spec, tw (with its w^T copy), backend, x_col (x^T in
    1x128 along T) and the dtypes. Its COL operands are QTensors in the layout the FP8 GEMM
    reads (dy^T, x^T, w^T: `fp8_block_gemm` multiplies a @ b^T); each is made only where its
    GEMM runs."""
    spec, tw, backend = ctx.spec, ctx.tw, ctx.backend
    ops = BackwardOperands(
        Backward.QUANTIZED,
        {
            (Operand.BWD_GRAD, Form.ROW): lambda: fp8_block_row(dy, spec, backend),
            (Operand.BWD_GRAD, Form.COL): lambda: fp8_block_col(dy, spec, backend),
            # w^T's square blocks, on the first backward; None where the FP8 GEMM does not run
            (Operand.FWD_WEIGHT, Form.COL): tw.col,
            (Operand.FWD_INPUT, Form.COL): lambda: ctx.x_col,
        },
    )
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dyq, w_col = ops.of(GemmKind.DGRAD)
        if w_col is not None:
            dx = fp8_block_gemm(dyq, w_col, spec)
        else:  # N not whole blocks, or off CUDA: the reference's formula, on w's own blocks
            dx = dequantize(dyq)[:, : dy.shape[1]] @ dequantize(tw.q)
    if ctx.needs_input_grad[1]:  # padded token columns are zeros in both: nothing to cut
        dw = fp8_block_gemm(*ops.of(GemmKind.WGRAD), spec)
    return (
        None if dx is None else dx.to(ctx.x_dtype),
        None if dw is None else dw.to(ctx.w_dtype),
    )


class TensorCoreQMatmul(torch.autograd.Function):
    """`QMatmul` on tensor cores: y = Qa(x) (x) Qw(w) in x's dtype, the backward of `mode`."""

    @staticmethod
    def forward(ctx, x, w, tw: QWeight, spec: TensorSpec, mode: Backward, backend):
        x_form = form_of(mode, GemmKind.WGRAD, Operand.FWD_INPUT)
        if spec.format is Format.MXFP8 and x_form is not Form.DEQ:
            # only the GEMM reads Qa(x): its bf16 values in one pass, no codes kept
            lp_x, _ = qdq_mxfp8(x.detach(), backend=backend)
            y, xq = mm_f32(lp_x, tw.operand(Form.LP, BF16).t()), None
        else:
            xq = quantize_activation(x, spec, backend)
            y = forward_gemm(xq, tw, spec)
        ctx.mode, ctx.tw, ctx.x_dtype, ctx.w_dtype = mode, tw, x.dtype, w.dtype
        ctx.spec, ctx.backend, ctx.rows = spec, backend, x.shape[0]
        # what the backward keeps of x: the form its WGRAD reads
        if x_form is Form.HP:
            ctx.save_for_backward(x, w)
        elif x_form is Form.DEQ:
            ctx.xq = xq  # a QTensor: its bytes, not a fp32 copy
            ctx.save_for_backward(w)
        elif spec.format is Format.FP8_BLOCK:
            ctx.x_col = fp8_block_col(x.detach(), spec, backend)
            ctx.save_for_backward(w)
        else:
            col = kernel_quantize(
                pad_rows(x.detach(), MXFP8_BLOCK), Format.MXFP8, axis=0, backend=backend
            )
            ctx.x_col = col
            ctx.save_for_backward(w)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        if ctx.mode is Backward.QUANTIZED and ctx.spec.format is Format.FP8_BLOCK:
            return *fp8_block_backward(ctx, dy), None, None, None, None
        ops = BackwardOperands(ctx.mode, _bf16_operands(ctx, dy))
        (dy_op, w_op), (dyt_op, x_op) = ops.of(GemmKind.DGRAD), ops.of(GemmKind.WGRAD)
        dx = mm_f32(dy_op, w_op).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = mm_f32(dyt_op.t(), x_op).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None


def _bf16_operands(ctx, dy: torch.Tensor) -> dict:
    """TensorCoreQMatmul's makers of each (operand, form) (`mxrl.nn.operands`) but block FP8's
    quantized ones: bf16, in the tensors' own layouts (dy [T, N], w [N, K], x [T, K]). Saved:
    (x, w) where the WGRAD reads x itself, else (w,). Both GEMMs' operands are made before
    either runs: MXFP8's column-wise weight copy is made (or refused) whichever gradients are
    asked for."""
    tw: QWeight = ctx.tw
    rows, backend = ctx.rows, ctx.backend
    # read only where a form needs x or w: reading checks their versions, and a weight
    # written since the forward must be refused by the column-wise copy's own message
    saved = functools.cache(lambda: ctx.saved_tensors)
    # MXFP8: both copies of dy from one read
    dy_row_and_col = functools.cache(
        lambda: qdq_mxfp8(pad_rows(dy, MXFP8_BLOCK), colwise=True, backend=backend)
    )
    return {
        (Operand.BWD_GRAD, Form.HP): lambda: dy.to(BF16),
        (Operand.FWD_WEIGHT, Form.HP): lambda: saved()[-1].to(BF16),
        (Operand.FWD_INPUT, Form.HP): lambda: saved()[0].to(BF16),
        (Operand.FWD_WEIGHT, Form.DEQ): lambda: tw.operand(Form.DEQ, BF16),
        (Operand.FWD_INPUT, Form.DEQ): lambda: kernel_dequantize(ctx.xq, backend=backend),
        (Operand.BWD_GRAD, Form.ROW): lambda: dy_row_and_col()[0][:rows],
        (Operand.BWD_GRAD, Form.COL): lambda: dy_row_and_col()[1][:rows],
        (Operand.FWD_WEIGHT, Form.COL): lambda: tw.operand(Form.COL, BF16),
        (Operand.FWD_INPUT, Form.COL): lambda: kernel_dequantize(ctx.x_col, backend=backend)[:rows],
    }
