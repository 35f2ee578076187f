"""Which kernels run: one record, `Kernels`, resolved once (house style 5).

`Kernels.resolve(backend, device, gemm)` is called when a run or an engine is set up;
`default_kernels(device)` (cached) is the record a public function uses when it is given no
backend. Asking for kernels the machine cannot run fails there, with a message naming the
requirement -- never by a try/except around a kernel call. Every field picks among
implementations that give the same bytes, or, for the GEMMs, the same numbers within the bounds
docs/kernels.md and docs/nn.md state.

Rules for the quantizer backend (`select_backend`):
- default (requested None): TRITON for a CUDA device when triton is importable, else REFERENCE.
  The CPU always gets REFERENCE.
- "reference": always allowed (pure PyTorch, any device).
- "triton": needs triton and a CUDA device; on the CPU only under Triton's interpreter
  (TRITON_INTERPRET=1, for debugging and the CPU kernel tests).

Rules for the trainer's GEMMs (`Gemm`; the modules in `mxrl.nn` run them):
- default (requested None): TENSOR_CORE on a CUDA device of compute capability 9.0+ (bf16 grouped
  GEMMs, FP8 tensor cores), else REFERENCE.
- "reference": always allowed. "tensor_core": refused on a CUDA device below sm_90; allowed on
  the CPU, where it runs the same algorithm slowly (the tests' way to check its logic).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from enum import StrEnum

import torch


class Backend(StrEnum):
    REFERENCE = "reference"
    TRITON = "triton"


class Gemm(StrEnum):
    """The trainer's GEMMs. REFERENCE: fp32 GEMMs on the operands docs/nn.md names, routed experts
    one at a time. TENSOR_CORE: bf16 tensor-core GEMMs with fp32 accumulation, routed experts as
    grouped GEMMs, block FP8 forward on FP8 tensor cores (`mxrl.nn.paths.tensor_core`)."""

    REFERENCE = "reference"
    TENSOR_CORE = "tensor_core"


@functools.cache
def triton_available() -> bool:
    """triton is importable (it is not a dependency of mxrl: it comes with CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreter_enabled() -> bool:
    """TRITON_INTERPRET=1: triton kernels run on CPU tensors, emulated with NumPy."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def select_backend(
    requested: Backend | str | None = None, device: torch.device | str | None = None
) -> Backend:
    """The quantizer backend for tensors on `device` (default: CUDA if available, else CPU)."""
    dev = torch.device(device) if device is not None else _default_device()
    return _select_backend(requested, dev)


def _select_backend(requested: Backend | str | None, dev: torch.device) -> Backend:
    if requested is None:
        if dev.type == "cuda" and triton_available():
            return Backend.TRITON
        return Backend.REFERENCE
    try:
        backend = Backend(requested)
    except ValueError:
        choices = ", ".join(repr(b.value) for b in Backend)
        raise ValueError(f"unknown kernel backend {requested!r}; choose one of {choices}") from None
    if backend is Backend.TRITON:
        check_triton_runs_on(dev)
    return backend


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(device: torch.device) -> tuple[int, int] | None:
    """A CUDA device's compute capability; None for any other device."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def tensor_cores_available(device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """A CUDA device with bf16 grouped GEMMs and FP8 tensor cores (sm_90+). capability: the
    device's (major, minor), read from the device when None."""
    if device.type != "cuda":
        return False
    return (capability or _device_capability(device)) >= (9, 0)


def _select_gemm(
    requested: Gemm | str | None, dev: torch.device, capability: tuple[int, int] | None
) -> Gemm:
    """The trainer's GEMMs for tensors on `dev` (the rules in the module docstring)."""
    if requested is None:
        return Gemm.TENSOR_CORE if tensor_cores_available(dev, capability) else Gemm.REFERENCE
    try:
        gemm = Gemm(requested)
    except ValueError:
        choices = ", ".join(repr(g.value) for g in Gemm)
        raise ValueError(f"unknown gemm {requested!r}; choose one of {choices}") from None
    if gemm is Gemm.TENSOR_CORE and not _gemm_allowed(dev, capability):
        cap = capability or _device_capability(dev)
        raise ValueError(
            f"gemm 'tensor_core' needs an sm_90+ GPU (bf16 grouped GEMMs, FP8 tensor cores); "
            f"{dev} is sm_{''.join(map(str, cap))}: use 'reference'"
        )
    return gemm


def _gemm_allowed(dev: torch.device, capability: tuple[int, int] | None) -> bool:
    # the CPU runs the tensor-core algorithm slowly (the tests' way to check its logic)
    return dev.type != "cuda" or tensor_cores_available(dev, capability)


@dataclass(frozen=True)
class Kernels:
    """Which implementation runs each kind of kernel on `device`: resolved once
    (`Kernels.resolve`), then handed whole, or one field of it, to whatever runs kernels."""

    device: torch.device
    quantizer: Backend  # quantize, dequantize, checksums: the same bytes on either
    train_gemm: Gemm  # the trainer's GEMMs: TENSOR_CORE on CUDA sm_90+, else REFERENCE
    rollout_gemm: Backend  # TRITON: the engine keeps NVFP4 / MXFP8 / block-FP8 weights packed
    attention: Backend  # TRITON: the paged attention kernel (where block size and head dim allow)
    rowwise: Backend  # TRITON: fused RMSNorm, RoPE, router top-k, MoE group / combine
    sampler: Backend  # TRITON on CUDA: the one-launch sampler

    def __post_init__(self) -> None:
        if not isinstance(self.device, torch.device):
            raise TypeError(
                f"Kernels.device must be a torch.device, got {self.device!r}: build the record "
                "with Kernels.resolve(backend, device)"
            )
        for name in ("quantizer", "rollout_gemm", "attention", "rowwise", "sampler"):
            if not isinstance(getattr(self, name), Backend):
                raise TypeError(f"Kernels.{name} must be a Backend, got {getattr(self, name)!r}")
        if not isinstance(self.train_gemm, Gemm):
            raise TypeError(f"Kernels.train_gemm must be a Gemm, got {self.train_gemm!r}")

    @classmethod
    def resolve(
        cls,
        backend: Backend | str | None,
        device: torch.device | str | None,
        gemm: Gemm | str | None = None,
        *,
        capability: tuple[int, int] | None = None,
    ) -> Kernels:
        """The record for `device` (None: CUDA if available, else the CPU). backend: the
        quantizer and the engine's Triton kernels (`select_backend`'s rules); gemm: the trainer's
        GEMMs (None: by device). capability: a CUDA device's (major, minor), read from the device
        when None (a test passes it to check the CUDA choice without a GPU)."""
        dev = torch.device(device) if device is not None else _default_device()
        chosen = _select_backend(backend, dev)
        return cls(
            device=dev,
            quantizer=chosen,
            train_gemm=_select_gemm(gemm, dev, capability),
            rollout_gemm=chosen,
            attention=chosen,
            rowwise=chosen,
            # the one-launch sampler is for the GPU; under the interpreter the CPU samples as torch
            sampler=chosen if dev.type == "cuda" else Backend.REFERENCE,
        )


@functools.cache
def default_kernels(device: torch.device) -> Kernels:
    """The record where a caller gave no backend: `Kernels.resolve(None, device)`, once per device."""
    return Kernels.resolve(None, device)


def backend_for(
    backend: Kernels | Backend | str | None,
    device: torch.device | str | None,
    field: str = "quantizer",
) -> Backend:
    """The backend a call runs: the record's `field` (quantizer, rollout_gemm, ...), the
    device's default when None (`default_kernels`), or a requested backend checked against the
    device (`select_backend`'s rules)."""
    dev = torch.device(device) if device is not None else _default_device()
    if backend is None:
        backend = default_kernels(dev)
    if isinstance(backend, Kernels):
        return getattr(backend, field)
    return _select_backend(backend, dev)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 under Triton's interpreter: few programs,
    each looping), for sizing launch grids."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def check_triton_runs_on(device: torch.device) -> None:
    """Raise ValueError naming what is missing for the triton backend on `device`."""
    if not triton_available():
        raise ValueError(
            "backend 'triton' needs the triton package (pip install triton, or a CUDA build of "
            "torch that ships it); use backend 'reference' on this machine"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("backend 'triton' on a CUDA device, but torch sees no CUDA device")
        return
    if device.type == "cpu" and triton_interpreter_enabled():
        return
    raise ValueError(
        f"backend 'triton' needs a CUDA device, got {device} (on the CPU it runs only under "
        "TRITON_INTERPRET=1, for debugging); use backend 'reference' there"
    )


# --- eager calls and traced calls ----------------------------------------------------------------
# In eager mode the kernels are called directly: `torch.library.wrap_triton` routes every launch
# through a higher-order op (dispatch + pytree flattening of the arguments), and the custom-op
# dispatch adds its own; together ~0.4 ms of host time per kernel on the H200, enough to make a
# training step wait on the host (measured: a quantized-backward MXFP8 step spent 19 ms of
# Python in 12 dense backward calls). Where something traces, both stay: torch.compile and
# CUDA-graph capture through compile see the ops whole (house style 6), and the ops' fake
# implementations run under FakeTensorMode.


def tracing() -> bool:
    """torch.compile is tracing, or a dispatch mode (FakeTensorMode, make_fx, a test's) is on."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def launcher(kernel, like: torch.Tensor):
    """What to index with a grid and call: the Triton kernel itself in eager mode, wrapped by
    `torch.library.wrap_triton` where something traces (see above). like: a tensor argument of
    the launch; a tensor subclass there (FakeTensor in an op's fake implementation, where the
    fake mode is no longer the current mode; a functional tensor under AOTAutograd) means a
    trace too."""
    if tracing() or type(like) not in (torch.Tensor, torch.nn.Parameter):
        from torch.library import wrap_triton

        return wrap_triton(kernel)
    return kernel
