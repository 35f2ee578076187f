"""Launch helpers for the torchrun tests (two CPU processes over gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.numeric_env import REPO


def torchrun(
    args: list[str],
    *,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 240,
    log: Path | None = None,
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N ARGS` from the repository root (one thread per
    process: two of them share the two cores CI has)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *args]  # fmt: skip
    out = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    if log is not None:
        log.write_text(out.stdout + out.stderr)
    return out


def tail(out: subprocess.CompletedProcess, n: int = 6000) -> str:
    """The end of a failed launch's output, without the warnings torchrun repeats per rank."""
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "Warning" not in ln]
    return "\n".join(lines)[-n:]
