"""Kernel tests: the GPU tier (`pytest -m gpu`) and, where triton is importable but CUDA is not,
the same kernels on small inputs under Triton's CPU interpreter (TRITON_INTERPRET=1).

The interpreter must be on before triton is first imported (triton.jit and triton.language read
the flag when they decorate). Without CUDA this file turns it on, which works when nothing has
imported triton yet (`pytest tests/kernels`); in a wider run where another test imported triton
first (torchao does), set TRITON_INTERPRET=1 in the environment or the interpreter tests skip.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None
# True when kernels can run under the interpreter in this process (see module docstring).
INTERPRETER_READY = False


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a runtime int into a 1-element array and converts it with
    int(array), which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted"), so
    `for k in range(0, K, BLOCK)` fails there. Convert through .item() instead (test-only)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_mxrl_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._mxrl_patched = True
    interpreter._patch_lang_tensor = patched


if TRITON_IMPORTABLE and not torch.cuda.is_available():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        INTERPRETER_READY = True
    elif "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
        INTERPRETER_READY = True
    if INTERPRETER_READY:
        _patch_interpreter_index()
