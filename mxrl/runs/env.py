"""The environment of a run (env.json): code version, library versions, device, host, start time.

Nothing here may fail a run: a missing git, a library that is not installed or a device that
cannot be queried gives "unknown" / null, never an exception.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import mxrl

# distribution names; the first installed one of each tuple is reported
LIBRARIES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton"),
    "transformers": ("transformers",),
    "safetensors": ("safetensors",),
    "numpy": ("numpy",),
}
_GIT_TIMEOUT_S = 5.0


def utc_now() -> str:
    """ISO 8601 UTC with milliseconds, e.g. 2025-06-01T12:03:04.123Z."""
    now = dt.datetime.now(dt.UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state(repo: Path | None = None) -> dict[str, Any]:
    """{"commit": sha or "unknown", "dirty": bool or None} of the checkout holding mxrl."""
    repo = repo if repo is not None else Path(mxrl.__file__).resolve().parent.parent
    commit = _git(["rev-parse", "HEAD"], repo)
    if not commit:
        return {"commit": "unknown", "dirty": None}
    status = _git(["status", "--porcelain", "--untracked-files=no"], repo)
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def source_sha256(package: Path | None = None) -> str | None:
    """sha256 over the package's files, its sources and data (presets, configs), not
    __pycache__ (each: its path relative to the package, a NUL, its bytes, a NUL; in path
    order): the code that ran, also where git's commit cannot say it (a copied tree beside a
    stale .git, an installed wheel). None when a file cannot be read."""
    root = package if package is not None else Path(mxrl.__file__).resolve().parent
    digest = hashlib.sha256()
    try:
        files = [p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    except OSError:
        return None
    return digest.hexdigest()


def _version(dists: tuple[str, ...]) -> str | None:
    for name in dists:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {
        "python": platform.python_version(),
        "mxrl": mxrl.__version__,
    }
    for lib, dists in LIBRARIES.items():
        versions[lib] = _version(dists)
    torch = sys.modules.get("torch")
    if torch is not None:  # the build actually imported (e.g. 2.13.0+cu128), not only installed
        versions["torch"] = str(torch.__version__)
    return versions


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu": cpu_model(), "cuda_devices": [], "cuda_count": 0}
    try:
        import torch

        info["cuda_version"] = torch.version.cuda
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            info["cuda_count"] = count
            info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(count)]
    except Exception as e:  # a broken driver must not stop a run from being recorded
        info["cuda_error"] = f"{type(e).__name__}: {e}"
    return info


def capture_env(backend: str | None = None) -> dict[str, Any]:
    """The content of env.json. backend: the kernel backend the caller resolved (a
    `mxrl.kernels.Backend` or its string), recorded as given."""
    return {
        "git": git_state(),
        "source_sha256": source_sha256(),
        "versions": library_versions(),
        "device": device_info(),
        "backend": None if backend is None else str(getattr(backend, "value", backend)),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "platform": platform.platform(),
        "argv": list(sys.argv),
        "start_time": utc_now(),
    }
