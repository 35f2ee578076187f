"""Quantized training ops: QLinear and grouped experts with the three backward modes.

from mxrl.nn import apply_plan
swaps = apply_plan(model, resolve("mxfp8", {n: p.shape for n, p in model.named_parameters()}))
set_gemm(model, "reference")   # the fp32 reference GEMMs (`mxrl.kernels.Gemm`) (default on the CPU; docs/nn.md)
"""

from mxrl.nn.apply import apply_plan, swap_table
from mxrl.nn.experts import GroupedExperts
from mxrl.nn.paths import set_gemm
from mxrl.nn.paths.reference import QMatmul
from mxrl.nn.qlinear import QExperts, QLinear
from mxrl.nn.swap import Swap
from mxrl.nn.weight import QWeight, WeightCache, weights_changed

__all__ = [
    "GroupedExperts",
    "QExperts",
    "QLinear",
    "QMatmul",
    "QWeight",
    "Swap",
    "WeightCache",
    "apply_plan",
    "set_gemm",
    "swap_table",
    "weights_changed",
]
