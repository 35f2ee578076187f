"""Which GEMMs the training ops run: chosen once per module (house style 5), by device by default.

- `Gemm.REFERENCE`: the CPU path and the test oracle. fp32 GEMMs on the operands docs/nn.md names
  (`mxrl.nn.qmatmul`), routed experts one expert at a time (a Python loop, a host sync for the
  token counts).
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
import functools
from enum import StrEnum

import torch


class Gemm(StrEnum):
    REFERENCE = "reference"
    TENSOR_CORE = "tensor_core"


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tensor_cores_available(device: torch.device) -> bool:
    """A CUDA device with bf16 grouped GEMMs and FP8 tensor cores (sm_90+)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (9, 0)


def select_gemm(requested: Gemm | str | None, device: torch.device | str) -> Gemm:
    """The GEMMs for tensors on `device`: TENSOR_CORE on CUDA sm_90+, else REFERENCE; a request
    the device cannot run is refused here, naming the requirement."""
    dev = torch.device(device)
    if requested is None:
        return Gemm.TENSOR_CORE if tensor_cores_available(dev) else Gemm.REFERENCE
    try:
        gemm = Gemm(requested)
    except ValueError:
        choices = ", ".join(repr(g.value) for g in Gemm)
        raise ValueError(f"unknown gemm {requested!r}; choose one of {choices}") from None
    if gemm is Gemm.TENSOR_CORE and dev.type == "cuda" and not tensor_cores_available(dev):
        raise ValueError(
            f"gemm 'tensor_core' needs an sm_90+ GPU (bf16 grouped GEMMs, FP8 tensor cores); "
            f"{dev} is sm_{''.join(map(str, _capability(dev.index or 0)))}: use 'reference'"
        )
    return gemm


def set_gemm(model: torch.nn.Module, gemm: Gemm | str | None) -> int:
    """Set the GEMMs of every training op of `model` (QLinear, GroupedExperts, QExperts); None
    restores the device default. Returns how many modules were set."""
    choice = None if gemm is None else Gemm(gemm)
    count = 0
    for module in model.modules():
        if hasattr(module, "gemm_choice"):
            module.gemm_choice = choice
            count += 1
    return count


def resolved_gemm(choice: Gemm | str | None, device: torch.device) -> Gemm:
    """A module's choice, or the device default (cached per device)."""
    return Gemm(choice) if choice is not None else _default_for(device)


@functools.cache
def _default_for(device: torch.device) -> Gemm:
    return select_gemm(None, device)


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
