"""The CPU numeric environments the tests run under.

A float result on the CPU depends on which kernels run it: ATen picks vectorized kernels by the
processor's capability (DEFAULT, AVX2, AVX512; `ATEN_CPU_CAPABILITY` lowers it), MKL picks its
own code path by processor (`MKL_ENABLE_INSTRUCTIONS`, `MKL_CBWR`), and both split reductions by
thread count. Two uses here:

- **The capability matrix** (`python -m tests.numeric_env` lists it; `make test` runs the tests
  marked `capability` once per entry, `python -m tests.numeric_env avx2 -m pytest ...`): every
  capability this CPU supports other than its native one, each with the matching MKL code path,
  so an AVX-512 machine also runs what an AVX2-only or a baseline x86-64 machine would.
- **The pinned environment** (`PINNED`) of the golden run, the same on every x86-64 machine:
  the golden metrics are a fixed point of the code, not of the processor.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ATen capability -> the MKL code path a processor with only that capability would take
MKL_INSTRUCTIONS = {"default": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512"}
# the capabilities a processor whose best is the key supports (ATen's names, lower case)
SUPPORTED = {
    "DEFAULT": ["default"],
    "AVX2": ["default", "avx2"],
    "AVX512": ["default", "avx2", "avx512"],
}

PINNED = {
    # ATen's scalar kernels, compiled for baseline x86-64 (no FMA): the same code on every CPU
    "ATEN_CPU_CAPABILITY": "default",
    # MKL's conditional numerical reproducibility: the same results on every x86 processor
    "MKL_CBWR": "COMPATIBLE",
    # one thread: MKL and ATen split reductions by thread count
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def native_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def other_capabilities(native: str | None = None) -> list[str]:
    """The capabilities to run the matrix under: all this CPU supports except its native one."""
    native = native or native_capability()
    supported = SUPPORTED.get(native, ["default"])
    return [c for c in supported if c.upper() != native]


# Set by `main` in the process it runs: the capability matrix's pytest knows it is one (a test
# may run one case per kind of numerics there, and every case in the main run).
MATRIX_VAR = "MXRL_CAPABILITY_MATRIX"


def in_capability_matrix() -> bool:
    return bool(os.environ.get(MATRIX_VAR))


def capability_env(capability: str) -> dict[str, str]:
    """Environment overrides that make this process behave as a `capability` processor."""
    env = {"ATEN_CPU_CAPABILITY": capability}
    if capability in MKL_INSTRUCTIONS:
        env["MKL_ENABLE_INSTRUCTIONS"] = MKL_INSTRUCTIONS[capability]
    return env


def run_python(args: list[str], overrides: dict[str, str], timeout: float = 600):
    """`python ARGS` from the repository root with `overrides` set before anything is imported."""
    env = {**os.environ, **overrides}
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def main(argv: list[str]) -> None:
    """`python -m tests.numeric_env`: the matrix's capabilities, one per line.
    `python -m tests.numeric_env CAP ARGS...`: run `python ARGS...` as a CAP processor would."""
    if not argv:
        print("\n".join(other_capabilities()))
        return
    cap, args = argv[0], argv[1:]
    if cap not in MKL_INSTRUCTIONS:
        sys.exit(f"unknown capability {cap!r}; one of {sorted(MKL_INSTRUCTIONS)}")
    print(f"tests.numeric_env: {' '.join(f'{k}={v}' for k, v in capability_env(cap).items())}")
    sys.stdout.flush()
    env = {**os.environ, **capability_env(cap), MATRIX_VAR: cap}
    os.execve(sys.executable, [sys.executable, *args], env)


if __name__ == "__main__":
    main(sys.argv[1:])
