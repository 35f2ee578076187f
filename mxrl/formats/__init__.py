"""The precision contract: one reference quantizer for MXFP8, NVFP4 and block FP8.

Pure PyTorch, eager, fp32 math in the order of spec/formats.md; same bytes on any device.

    from mxrl.formats import quantize, dequantize, QTensor, swizzle_scales
    q = quantize(x, "nvfp4", per_token=True)
    x_hat = dequantize(q)
"""

from mxrl.formats.api import (
    QuantizeOptions,
    check_request,
    decode_global_scale,
    dequantize,
    quantize,
)
from mxrl.formats.constants import Format
from mxrl.formats.layout import swizzle_scales, unswizzle_scales
from mxrl.formats.numerics import sqnr_db, tensor_hash
from mxrl.formats.qtensor import GLOBAL_SCALES, QTensor, stored_layout

__all__ = [
    "GLOBAL_SCALES",
    "Format",
    "QTensor",
    "QuantizeOptions",
    "check_request",
    "decode_global_scale",
    "dequantize",
    "quantize",
    "sqnr_db",
    "stored_layout",
    "swizzle_scales",
    "tensor_hash",
    "unswizzle_scales",
]
