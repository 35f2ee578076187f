"""The role of every GEMM operand of a quantized linear layer, by backward mode (docs/design.md
§4.5, §7): which tensor each GEMM reads (`Operand`) and in which form (`Form`), one table
(`OPERANDS`) that the reference (`nn/paths/reference.py`), tensor-core
(`nn/paths/tensor_core.py`) and grouped (`nn/paths/grouped.py`) backwards read their operands
through.

Named after TransformerEngine's recipe fields (`fp8_quant_fwd_inp`, `fp8_quant_fwd_weight`,
`fp8_quant_bwd_grad`) and GEMMs (fprop, dgrad, wgrad).

Legend: x [T, K] the forward's input, w [N, K] the weight, dy [T, N] the output's gradient. Each
pair (A, B) of the table is in the GEMM's order:
  FPROP  y  = A @ B^T  (then the global scales)
  DGRAD  dx = A @ B
  WGRAD  dw = A^T @ B
where each operand is a tensor in its own layout (x, w, dy as above); a path whose GEMM takes
quantized codes holds a COL copy in the layout its kernel reads (block FP8: x^T, dy^T, w^T).
What a form is made of on each format (MXFP8's 32x1 blocks, block FP8's 1x128 along the tokens
and the forward's own square weight blocks) is the path's, in its module docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any

from mxrl.recipe import Backward


class Operand(StrEnum):
    FWD_INPUT = "fwd_inp"
    FWD_WEIGHT = "fwd_weight"
    BWD_GRAD = "bwd_grad"


class GemmKind(StrEnum):
    FPROP = "fprop"
    DGRAD = "dgrad"
    WGRAD = "wgrad"


class Form(StrEnum):
    HP = "hp"  # the high-precision tensor itself
    LP = "lp"  # dequantized without the NVFP4 global scale (the forward GEMM's operand; §2)
    DEQ = "deq"  # fully dequantized, the forward's row-wise quantization
    ROW = "row"  # dequantized from a row-wise quantization made for this GEMM
    COL = "col"  # dequantized from the column-wise quantization of the high-precision tensor


Pair = tuple[tuple[Operand, Form], tuple[Operand, Form]]

_FPROP: Pair = ((Operand.FWD_INPUT, Form.LP), (Operand.FWD_WEIGHT, Form.LP))

OPERANDS: dict[tuple[Backward, GemmKind], Pair] = {
    (Backward.HIGH_PRECISION, GemmKind.FPROP): _FPROP,
    (Backward.HIGH_PRECISION, GemmKind.DGRAD): (
        (Operand.BWD_GRAD, Form.HP),
        (Operand.FWD_WEIGHT, Form.HP),
    ),
    (Backward.HIGH_PRECISION, GemmKind.WGRAD): (
        (Operand.BWD_GRAD, Form.HP),
        (Operand.FWD_INPUT, Form.HP),
    ),
    (Backward.DEQUANTIZED, GemmKind.FPROP): _FPROP,
    (Backward.DEQUANTIZED, GemmKind.DGRAD): (
        (Operand.BWD_GRAD, Form.HP),
        (Operand.FWD_WEIGHT, Form.DEQ),
    ),
    (Backward.DEQUANTIZED, GemmKind.WGRAD): (
        (Operand.BWD_GRAD, Form.HP),
        (Operand.FWD_INPUT, Form.DEQ),
    ),
    (Backward.QUANTIZED, GemmKind.FPROP): _FPROP,
    (Backward.QUANTIZED, GemmKind.DGRAD): (
        (Operand.BWD_GRAD, Form.ROW),
        (Operand.FWD_WEIGHT, Form.COL),
    ),
    (Backward.QUANTIZED, GemmKind.WGRAD): (
        (Operand.BWD_GRAD, Form.COL),
        (Operand.FWD_INPUT, Form.COL),
    ),
}


def form_of(mode: Backward, gemm: GemmKind, operand: Operand) -> Form:
    """The form in which `gemm` reads `operand` under `mode` (the forward asks which form of x
    the WGRAD reads, to keep just that)."""
    for op, form in OPERANDS[(mode, gemm)]:
        if op is operand:
            return form
    raise KeyError(f"{gemm} does not read {operand}")


class BackwardOperands:
    """The operands of one backward's GEMMs under `mode`, through `OPERANDS`: `makers` maps each
    (operand, form) a path can make to a function of nothing that makes it; each is made once,
    on the first GEMM that reads it (dy in one form is one tensor for both GEMMs)."""

    def __init__(self, mode: Backward, makers: dict[tuple[Operand, Form], Callable[[], Any]]):
        self.mode = mode
        self._makers = makers
        self._made: dict[tuple[Operand, Form], Any] = {}

    def of(self, gemm: GemmKind) -> tuple[Any, Any]:
        """(A, B) of `gemm`, in the order of the module docstring's formulas."""
        a, b = (self._get(key) for key in OPERANDS[(self.mode, gemm)])
        return a, b

    def _get(self, key: tuple[Operand, Form]) -> Any:
        if key not in self._made:
            self._made[key] = self._makers[key]()
        return self._made[key]
