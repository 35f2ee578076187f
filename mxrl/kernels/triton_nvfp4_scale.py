"""NVFP4's global scale on the GPU (Triton): the tensor's global amax over its finite elements,
and S_enc = `nvfp4_encode_scale(amax)` element-wise (`mxrl.kernels.triton_nvfp4` quantizes
with them; spec §3.2)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxrl.kernels.backend import launcher, num_sms
from mxrl.kernels.triton_codecs import finite_abs, nvfp4_encode_scale

AMAX_CONFIG = {"BLOCK": 4096, "num_warps": 8, "programs_per_sm": 8}


@triton.jit(do_not_specialize=["N", "ITERS"])
def _amax_kernel(x_ptr, amax_bits_ptr, N, ITERS, BLOCK: tl.constexpr, INDEX_64: tl.constexpr):
    """max |x| over the finite elements of the whole tensor, as fp32 bits in one int32 (atomic
    max: non-negative floats order like their bit patterns; max is order-independent)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for it in range(0, ITERS):
        offs = (it * num_programs + pid) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, finite_abs(x))
    tl.atomic_max(amax_bits_ptr, tl.max(acc, axis=0).to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["N"])
def _encode_scale_kernel(amax_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    amax = tl.load(amax_ptr + offs, mask=offs < N, other=0.0)
    tl.store(out_ptr + offs, nvfp4_encode_scale(amax), mask=offs < N)


def launch_global_amax(x_MK: torch.Tensor) -> torch.Tensor:
    """fp32 [] global max |x| over the finite elements (NaN and ±Inf ignored)."""
    assert x_MK.is_contiguous()
    bits = torch.zeros((), dtype=torch.int32, device=x_MK.device)
    n = x_MK.numel()
    if n:
        cfg = AMAX_CONFIG
        num_blocks = triton.cdiv(n, cfg["BLOCK"])
        programs = min(num_blocks, num_sms(x_MK.device) * cfg["programs_per_sm"])
        launcher(_amax_kernel, x_MK)[(programs,)](
            x_MK,
            bits,
            n,
            triton.cdiv(num_blocks, programs),
            BLOCK=cfg["BLOCK"],
            INDEX_64=n >= 2**31,
            num_warps=cfg["num_warps"],
        )
    return bits.view(torch.float32)


def launch_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc (§3.2) element-wise, same shape as `amax` (fp32, contiguous)."""
    assert amax.dtype == torch.float32 and amax.is_contiguous()
    out = torch.empty_like(amax)
    n = amax.numel()
    if n:
        block = 1024
        launcher(_encode_scale_kernel, amax)[(triton.cdiv(n, block),)](amax, out, n, BLOCK=block)
    return out
