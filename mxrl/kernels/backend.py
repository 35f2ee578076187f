"""Which implementation quantizes: chosen once, from configuration (house style 5).

`select_backend` is called when a config is built (or once per device by `mxrl.kernels.quantize`
when no backend is passed); asking for a backend the machine cannot run fails there, with a
message naming the requirement -- never by a try/except around a kernel call.

Rules:
- default (requested None): TRITON for a CUDA device when triton is importable, else REFERENCE.
  The CPU always gets REFERENCE.
- "reference": always allowed (pure PyTorch, any device).
- "triton": needs triton and a CUDA device; on the CPU only under Triton's interpreter
  (TRITON_INTERPRET=1, for debugging and the CPU kernel tests).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from enum import StrEnum

import torch


class Backend(StrEnum):
    REFERENCE = "reference"
    TRITON = "triton"


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
    """The backend for tensors on `device` (default: CUDA if available, else CPU)."""
    dev = torch.device(device) if device is not None else _default_device()
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
