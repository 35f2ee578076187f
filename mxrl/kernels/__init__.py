"""Fast paths (Triton on CUDA): quantizers byte-exact with the reference in `mxrl.formats`, and
GEMMs with low-bit weights within a stated bound of the emulated GEMM (`decode_gemm`).

    from mxrl.kernels import Kernels, quantize, low_bit_linear
    kernels = Kernels.resolve(cfg.kernel_backend, device)   # once, from config
    q = quantize(x, "nvfp4", per_token=True, backend=kernels.quantizer)
    y = low_bit_linear(x, wq, backend=kernels.rollout_gemm)  # GEMM with a packed weight (decode)

Importing this package does not import triton (CI has none): the kernels load on first use of
the triton backend. docs/kernels.md lists each kernel and the reference it matches.
"""

from mxrl.kernels.api import (
    dequantize,
    error_sums,
    padded_rows,
    qdq_mxfp8,
    quantize,
    quantize_measured,
    quantize_mxfp8_both,
    quantize_mxfp8_padded,
    scale_bf16,
    to_float32,
)
from mxrl.kernels.backend import (
    Backend,
    Gemm,
    Kernels,
    default_kernels,
    select_backend,
    triton_available,
)
from mxrl.kernels.decode_gemm import (
    GemmConfig,
    grouped_low_bit_linear,
    grouped_low_bit_matmul,
    low_bit_linear,
    low_bit_matmul,
)

__all__ = [
    "Backend",
    "Gemm",
    "GemmConfig",
    "Kernels",
    "default_kernels",
    "dequantize",
    "error_sums",
    "grouped_low_bit_linear",
    "grouped_low_bit_matmul",
    "low_bit_linear",
    "low_bit_matmul",
    "padded_rows",
    "qdq_mxfp8",
    "quantize",
    "quantize_measured",
    "quantize_mxfp8_both",
    "quantize_mxfp8_padded",
    "scale_bf16",
    "select_backend",
    "to_float32",
    "triton_available",
]
