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


def _patch_interpreter_helper_calls() -> None:
    """Triton 3.6's interpreter patches triton.language at a launch and again at every call of
    a @triton.jit helper inside it (InterpretedFunction.__call__), never undoing the latter. A
    second patch of a module changes nothing: builtins already patched are left as they are, the
    rest set again to the same stateless replacements. That repetition was a fifth of the
    Triton tier's time. Here a helper inside a launch patches only a language module the launch
    has not patched yet (tl.core, seen by tl.sum & co.), as the first such call did before.
    Only on the Triton read here (3.6): another keeps its interpreter as it is."""
    import inspect

    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if not triton.__version__.startswith("3.6."):
        return
    original = interpreter._patch_lang
    if getattr(original, "_mxrl_patched", False):
        return
    patched_in_launch: list[set[int]] = []  # the language modules patched in the launch running

    def langs(fn) -> set[int]:
        found = (v for v in fn.__globals__.values() if inspect.ismodule(v))
        return {id(v) for v in found if v is tl or v is tl.core}

    def patched(fn):
        if patched_in_launch:  # a helper called inside a launch: its scope is dropped
            seen = langs(fn)
            if seen <= patched_in_launch[-1]:
                return interpreter._LangPatchScope()
            patched_in_launch[-1] |= seen
            return original(fn)
        scope = original(fn)  # a launch: restored when its grid has run
        patched_in_launch.append(langs(fn))
        restore = scope.restore

        def restore_and_forget() -> None:
            patched_in_launch.pop()
            restore()

        scope.restore = restore_and_forget
        return scope

    patched._mxrl_patched = True
    interpreter._patch_lang = patched


if TRITON_IMPORTABLE and not torch.cuda.is_available():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        INTERPRETER_READY = True
    elif "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
        INTERPRETER_READY = True
    if INTERPRETER_READY:
        _patch_interpreter_index()
        _patch_interpreter_helper_calls()
