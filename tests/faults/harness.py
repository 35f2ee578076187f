"""The faults tier's one assertion: a refused command exits 2 with one `mxrl: error:` line that
names the culprit, prints no traceback, and changes no file that existed before it ran.

    before = snapshot(tmp_path)
    result = run_mxrl(["train", "--config", str(cfg)], cwd=tmp_path)
    assert_refused(result, "rl.lr", before, snapshot(tmp_path), fresh=[tmp_path / "runs"])

Each case runs the real console entry point (`python -m mxrl.cli`) in a child process, so what
is asserted is what a user sees: the exit code, stderr, the files on disk.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXIT_USAGE = 2
ERROR_PREFIX = "mxrl: error: "


@dataclass(frozen=True)
class Result:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith(ERROR_PREFIX)]


def run_mxrl(
    args: Sequence[str],
    cwd: Path,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> Result:
    """`mxrl ARGS` in a child process, from `cwd`, on the CPU, with the repository importable."""
    child_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "mxrl.cli", *args],
        cwd=cwd,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Result(tuple(args), proc.returncode, proc.stdout, proc.stderr)


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots` (and of each root that is a file), by path; a folder
    is recorded too, so a created or removed empty folder shows."""
    out: dict[str, str] = {}
    for root in roots:
        root = Path(root)
        if root.is_file():
            out[str(root)] = _sha256(root)
            continue
        if not root.exists():
            continue
        for dirpath, _dirnames, filenames in os.walk(root):
            out[dirpath + os.sep] = "dir"
            for name in filenames:
                path = Path(dirpath) / name
                out[str(path)] = _sha256(path)
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_refused(
    result: Result,
    culprit: str | re.Pattern[str],
    before: dict[str, str],
    after: dict[str, str],
    *,
    fresh: Iterable[Path] = (),
) -> None:
    """The refusal contract: exit code 2; exactly one `mxrl: error:` line on
    stderr and nothing after it; the line names `culprit` (a substring, or a regex to search);
    no traceback; and no file in `before` changed or vanished. A file or folder that appeared
    is allowed only under a `fresh` path (an output folder the command was told to create)."""
    shown = f"mxrl {' '.join(result.args)}\n--- stderr ---\n{result.stderr}\n--- stdout ---\n{result.stdout}"
    assert result.returncode == EXIT_USAGE, f"exit code {result.returncode}, want 2\n{shown}"
    assert "Traceback" not in result.stderr, f"a traceback for a user error\n{shown}"
    lines = result.error_lines
    assert len(lines) == 1, f"want exactly one '{ERROR_PREFIX}' line, got {len(lines)}\n{shown}"
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last == lines[0], f"the error line must be the last thing on stderr\n{shown}"
    found = culprit.search(lines[0]) if isinstance(culprit, re.Pattern) else culprit in lines[0]
    assert found, f"the error line does not name {culprit!r}: {lines[0]!r}"
    changed = sorted(p for p, h in before.items() if after.get(p) != h)
    assert not changed, f"a refused command changed or removed {changed}\n{shown}"
    fresh_roots = [str(Path(p)) for p in fresh]
    new = sorted(
        p
        for p in set(after) - set(before)
        if not any(p == r + os.sep or p.startswith(r + os.sep) or p == r for r in fresh_roots)
    )
    assert not new, f"a refused command created {new}\n{shown}"
