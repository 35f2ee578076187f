"""`write_kv_fp8`: the FP8 KV cache's write of one step in one Triton launch per keys or values
(mxrl/kernels/triton_kv_write.py). Its reference, and the path every other case takes, is
`mxrl.engine.kv_cache.KVCache.write`: `mxrl.nn.kv_quant.quantize_kv` (the one block-FP8
quantizer) then the codes and scales copied to their slots; the same bytes
(tests/kernels/test_kv_write.py)."""

from __future__ import annotations

import torch

from mxrl.kernels.api import KERNEL_FP8_BLOCK_SIZES
from mxrl.kernels.backend import Backend, Kernels, backend_for


def fused_write_fits(x_TKD: torch.Tensor, backend: Kernels | Backend | str | None) -> bool:
    """The fused write takes x_TKD: the triton backend on its device, a head dim of the block
    FP8 kernels' blocks, elements contiguous along it."""
    return (
        x_TKD.dim() == 3
        and x_TKD.shape[-1] in KERNEL_FP8_BLOCK_SIZES
        and x_TKD.stride(-1) == 1
        and backend_for(backend, x_TKD.device) is Backend.TRITON
    )


def write_kv_fp8(
    x_TKD: torch.Tensor, slots: torch.Tensor, codes_SKD: torch.Tensor, scales_SK: torch.Tensor
) -> None:
    """Store x_TKD [T, K, D] (the compute dtype) at rows `slots` (int64 [T]) of an FP8 cache
    layer: E4M3 codes into codes_SKD (u8 [S, K, D]) and fp32 scales into scales_SK ([S, K]),
    both contiguous. The caller checked `fused_write_fits`."""
    from mxrl.kernels.triton_kv_write import launch_kv_write_fp8

    t, heads, d = x_TKD.shape
    if (
        codes_SKD.dtype != torch.uint8
        or codes_SKD.shape[1:] != (heads, d)
        or scales_SK.shape != codes_SKD.shape[:2]
        or scales_SK.dtype != torch.float32
        or not (codes_SKD.is_contiguous() and scales_SK.is_contiguous())
        or slots.shape != (t,)
    ):
        raise ValueError(
            f"write_kv_fp8: x {tuple(x_TKD.shape)}, slots {tuple(slots.shape)} do not fit the "
            f"cache layer {tuple(codes_SKD.shape)} {codes_SKD.dtype} / "
            f"{tuple(scales_SK.shape)} {scales_SK.dtype} (contiguous u8 [S, K, D], fp32 [S, K])"
        )
    launch_kv_write_fp8(x_TKD, slots, codes_SKD, scales_SK)
