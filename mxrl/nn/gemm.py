"""The training ops' GEMM helpers, and `resolved_gemm`: which GEMMs a module runs (`Gemm`, chosen
by `mxrl.kernels.Kernels.resolve`; by device by default, house style 5; a module holds the path
that runs them, `mxrl.nn.paths.set_gemm`).

- `Gemm.REFERENCE`: the CPU path and the test oracle. fp32 GEMMs on the operands docs/nn.md names
  (`mxrl.nn.paths.reference`), routed experts one expert at a time (a Python loop, a host sync
  for the token counts).
- `Gemm.TENSOR_CORE` (default on CUDA sm_90+): bf16 tensor-core GEMMs with fp32 accumulation,
  routed experts as grouped GEMMs (`torch._grouped_mm`, offsets on the device, no host sync),
  block FP8 forward on FP8 tensor cores (`mxrl.kernels.fp8_gemm`). MXFP8 and NVFP4 operands
  dequantized without their FP32 global scale are exact in bf16 (an E4M3 or E2M1 x E4M3 value
  has at most 6 significant bits; times 2^k it stays in bf16's exponent range for any block
  amax above 2^-116), so their products are the reference's exactly and only the fp32
  summation order and the output rounding differ. docs/nn.md, "Fast paths", states the bounds.
  On the CPU it runs the same algorithm slowly (the tests' way to check its logic).
"""

from __future__ import annotations

import contextlib

import torch

from mxrl.kernels.backend import Gemm, default_kernels


def resolved_gemm(choice: Gemm | str | None, device: torch.device) -> Gemm:
    """A module's choice (its path's `Gemm`, `gemm_choice`), or the device default
    (`default_kernels(device).train_gemm`, cached)."""
    return Gemm(choice) if choice is not None else default_kernels(device).train_gemm


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 [M, N] = a [M, K] @ b [K, N] for bf16 a, b: exact products, fp32 sums (tensor cores
    on CUDA, `torch.mm(..., out_dtype=float32)`; fp32 GEMM of the same values elsewhere)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm` in bf16 (fp32 accumulation, bf16 output). ends: int32 [E], the end
    row of each group (rows of a for a 2-D x 3-D product; the reduction for 2-D x 2-D)."""
    return torch._grouped_mm(a.to(torch.bfloat16), b.to(torch.bfloat16), offs=ends)


def no_autocast(device: torch.device):
    """The quantized ops choose their own operand dtypes: outside autocast's casts (a no-op
    context when autocast is off, as in every reference run)."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
