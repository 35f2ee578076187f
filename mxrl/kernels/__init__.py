"""Fast paths (Triton on CUDA), each byte-exact with the reference in `mxrl.formats`.

    from mxrl.kernels import Backend, quantize, quantize_mxfp8_both, select_backend
    backend = select_backend(cfg.kernel_backend, device)   # once, from config
    q = quantize(x, "nvfp4", per_token=True, backend=backend)

Importing this package does not import triton (CI has none): the kernels load on first use of
the triton backend. docs/kernels.md lists each kernel and the reference it matches.
"""

from mxrl.kernels.api import quantize, quantize_mxfp8_both
from mxrl.kernels.backend import Backend, select_backend, triton_available

__all__ = ["Backend", "quantize", "quantize_mxfp8_both", "select_backend", "triton_available"]
