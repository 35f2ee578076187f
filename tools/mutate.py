"""Mutation testing of one critical module: `make mutate MODULE=engine` (docs/mutation/README.md).

Runs mutmut on the module's files against the module's tests in a scratch copy of the
repository (`.mutate/<module>/`, git-ignored; mutmut keeps its results there, so a second run
only tests the mutants of changed code), then writes `docs/mutation/<module>.md`: killed,
survived, equivalent and timed-out mutants, each survivor with its file:line and change. A
survivor is either killed by a new test or argued equivalent in docs/mutation/equivalent.toml
(matched by file and by the changed lines, so an argument follows its code, not mutmut's
numbering).

    python tools/mutate.py MODULE [--max-children N] [--report-only] [--mutant NAME ...]
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import filecmp
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EQUIVALENT = REPO / "docs" / "mutation" / "equivalent.toml"
MUTMUT_VERSION = "3.8.1"

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from mutate_modules import MODULES, Module  # noqa: E402

# Lines (and the whole statements they start) left alone: a raise's message, a log line.
DO_NOT_MUTATE = (
    r"^\s*raise [A-Za-z_.]+\(",
    r"^\s*(logger|logging|log)\.(debug|info|warning|error|exception)\(",
    r"^\s*warnings\.warn\(",
)


def _tracked_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, check=True, text=True,
    )  # fmt: skip
    return [f for f in out.stdout.split("\0") if f and (REPO / f).is_file()]


def _sync(work: Path) -> None:
    """The repository's files into `work` (changed ones only: mutmut's cache keys on them)."""
    files = set(_tracked_files())
    for rel in files:
        src, dst = REPO / rel, work / rel
        if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    for top in ("mxrl", "tests", "docs"):  # files deleted from the repository
        for path in (work / top).rglob("*"):
            rel = str(path.relative_to(work))
            if path.is_file() and "__pycache__" not in path.parts and rel not in files:
                path.unlink()


def _toml_list(items) -> str:
    return "[" + ", ".join(json.dumps(x) for x in items) + "]"  # JSON strings are TOML strings


def _configure(work: Path, module: Module) -> None:
    """The repository's pyproject.toml plus a [tool.mutmut] section for this module."""
    text = (REPO / "pyproject.toml").read_text()
    # the interpreter's kernel tests are `triton`-marked: run them where the module asks for
    # the interpreter, leave them out elsewhere (each is seconds where a plain test is ms)
    markers = "not gpu" if dict(module.env).get("TRITON_INTERPRET") == "1" else "not triton"
    text += f"""
[tool.mutmut]
source_paths = ["mxrl"]
only_mutate = {_toml_list(module.files)}
pytest_add_cli_args_test_selection = {_toml_list(module.tests)}
pytest_add_cli_args = ["-p", "no:cacheprovider", "-m", "{markers}"]
# docs and benchmarks: tests read them (doc hashes, benchmark scripts)
also_copy = ["README.md", "docs", "benchmarks", "Makefile"]
# torch is not fork-safe after it ran a test: workers fork from a process that only imported
process_isolation = "forkserver"
# out of scope: the wording of refusals and logs (every condition that raises is mutated)
do_not_mutate_patterns = {_toml_list(DO_NOT_MUTATE)}
"""
    (work / "pyproject.toml").write_text(text)


def _run_mutmut(work: Path, max_children: int, names: list[str], extra_env: dict) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", **extra_env}
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children), *names]
    print("tools/mutate.py:", " ".join(cmd), f"(in {work})", flush=True)
    subprocess.run(cmd, cwd=work, env=env, check=False)


# --- the report ---------------------------------------------------------------------------


@dataclass
class Mutant:
    name: str
    status: str
    file: str
    line: int
    function: str
    was: str  # the original line(s), stripped
    now: str  # the mutated line(s), stripped


def _collect(work: Path, module: Module) -> list[Mutant]:
    """Every mutant of the module's files with its status and its change in file lines (the
    mutated function put back into the original file and compared line by line)."""
    os.chdir(work)
    sys.path.insert(0, str(work))
    import libcst as cst
    from mutmut.mutation import diff_apply
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.file_utils import walk_mutatable_files

    scope = module.mutant_globs()
    mutants = []
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        if not data.exit_code_by_key:
            continue
        source = Path(path).read_text()
        original = cst.parse_module(source)
        mutated_module = diff_apply.read_mutants_module(path)
        for name, code in sorted(data.exit_code_by_key.items(), key=lambda kv: _order(kv[0])):
            if scope and not any(fnmatch.fnmatchcase(name, glob) for glob in scope):
                continue  # a function of the file the module leaves out
            function, cls = _function_of(name)
            orig_fn = _find(original, function, cls)
            mutant_fn = _find(mutated_module, name.rpartition(".")[-1], cls)
            new = original.deep_replace(orig_fn, mutant_fn.with_changes(name=orig_fn.name))
            line, was, now = _changed(source, new.code)
            label = f"{cls}.{function}" if cls else function
            mutants.append(
                Mutant(name, status_by_exit_code[code], str(path), line, label, was, now)
            )
    return mutants


def _order(name: str) -> tuple[str, int]:
    head, _, number = name.rpartition("__mutmut_")
    return head, int(number) if number.isdigit() else 0


def _function_of(name: str) -> tuple[str, str | None]:
    """`pkg.mod.x_func__mutmut_3` -> (func, None); `pkg.mod.xǁClassǁmethod__mutmut_3` ->
    (method, Class)."""
    mangled = name.rpartition(".")[-1].rpartition("__mutmut_")[0]
    if mangled.startswith("x\u01c1"):
        _, cls, function = mangled.split("\u01c1")
        return function, cls
    return mangled.removeprefix("x_"), None


def _find(module, name: str, cls: str | None):
    import libcst as cst

    body = module.body
    if cls is not None:
        owner = next(c for c in body if isinstance(c, cst.ClassDef) and c.name.value == cls)
        body = owner.body.body
    return next(f for f in body if isinstance(f, cst.FunctionDef) and f.name.value == name)


def _changed(before: str, after: str) -> tuple[int, str, str]:
    a, b = before.splitlines(), after.splitlines()
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            was = "\n".join(x.strip() for x in a[i1:i2])
            now = "\n".join(x.strip() for x in b[j1:j2])
            return i1 + 1, was, now
    return 0, "", ""  # no textual change (mutmut would not produce one)


def _equivalents() -> list[dict]:
    if not EQUIVALENT.exists():
        return []
    return tomllib.loads(EQUIVALENT.read_text()).get("mutant", [])


def _argued(m: Mutant, equivalents: list[dict]) -> dict | None:
    for e in equivalents:
        if (e["file"], e["was"].strip(), e["now"].strip()) == (m.file, m.was, m.now):
            return e
    return None


def _code(text: str) -> str:
    return "`" + text.replace("\n", " ⏎ ").replace("`", "'") + "`" if text else "(nothing)"


def _report(module_name: str, module: Module, mutants: list[Mutant]) -> str:
    equivalents = _equivalents()
    groups: dict[str, list[tuple[Mutant, str | None]]] = {}
    for m in mutants:
        entry = _argued(m, equivalents) if m.status == "survived" else None
        key = m.status
        if entry is not None:  # equivalent, or killed by a test that cannot run here (GPU)
            key = "gpu" if "killed_by" in entry else "equivalent"
        why = None
        if entry is not None:
            why = entry["why"] + (f" Killed by `{entry['killed_by']}`." if key == "gpu" else "")
        groups.setdefault(key, []).append((m, why))
    count = {k: len(v) for k, v in groups.items()}
    killed = count.get("killed", 0) + count.get("gpu", 0)
    timeout, equivalent = count.get("timeout", 0), count.get("equivalent", 0)
    survived = count.get("survived", 0)
    no_tests = count.get("no tests", 0)
    other = len(mutants) - killed - timeout - equivalent - survived - no_tests
    scored = len(mutants) - equivalent - no_tests
    rate = (killed + timeout) / scored if scored else 1.0

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", "HEAD").strip()
    if git("status", "--porcelain", "--untracked-files=no").strip():
        commit += " with uncommitted changes"
    lines = [
        f"# Mutation report: `{module_name}`",
        "",
        f"`make mutate MODULE={module_name}` (mutmut {MUTMUT_VERSION}) at {commit}, "
        f"{datetime.date.today().isoformat()}. Mutated: {', '.join(f'`{f}`' for f in module.files)}; "
        f"tests: {', '.join(f'`{t}`' for t in module.tests)}. "
        + (
            f"In scope: {', '.join(f'`{f}`' for f in module.functions)} (the other functions of "
            "the files are not mutated here). "
            if module.functions
            else ""
        )
        + "How to read and refresh this: "
        "[README.md](README.md).",
        "",
        "| killed (on the GPU tier) | timeout | survived | equivalent | no tests | other | total "
        "| kill rate |",
        "|---|---|---|---|---|---|---|---|",
        f"| {killed} ({count.get('gpu', 0)}) | {timeout} | {survived} | {equivalent} "
        f"| {count.get('no tests', 0)} | {other} | {len(mutants)} | {rate:.1%} |",
        "",
        "Kill rate: (killed + timeout) / (total - equivalent - no tests); a timeout is a mutant "
        "the tests stopped (it made them hang or loop); killed counts the mutants only a GPU-tier "
        "test kills (listed below: mutmut runs on the CPU).",
        "",
    ]
    sections = [
        ("survived", "Survivors (each needs a test that kills it, or an argument below)"),
        ("equivalent", "Equivalent (argued in `docs/mutation/equivalent.toml`)"),
        ("gpu", "Killed on the GPU tier only (equivalent on the CPU, where mutmut runs)"),
        ("no tests", "No test reaches the function"),
        ("timeout", "Timeouts"),
    ]
    for key, title in sections:
        rows = groups.get(key, [])
        lines += [f"## {title}: {len(rows)}", ""]
        for m, why in rows:
            lines.append(
                f"- `{m.file}:{m.line}` `{m.function}`: {_code(m.was)} → {_code(m.now)} "
                f"(`{m.name.rpartition('.')[-1]}`)" + (f". {why}" if why else "")
            )
        lines.append("")
    rest = sorted(set(groups) - {"killed", "survived", "no tests", "timeout", "equivalent", "gpu"})
    for status in rest:
        lines += [f"## {status}: {count.get(status, 0)}", ""]
        lines += [f"- `{m.file}:{m.line}` `{m.function}` (`{m.name}`)" for m, _ in groups[status]]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", nargs="?", choices=sorted(MODULES))
    parser.add_argument("--list", action="store_true", help="print the module names")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--report-only", action="store_true", help="rewrite the report only")
    parser.add_argument(
        "--mutant", action="append", default=[], metavar="NAME",
        help="test these mutants again (mutmut names or globs, e.g. after adding a test)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.list or args.module is None:
        print(" ".join(sorted(MODULES)))
        return 0 if args.list else 2
    module = MODULES[args.module]
    work = REPO / ".mutate" / args.module
    work.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        _sync(work)
        _configure(work, module)
        globs = args.mutant or module.mutant_globs()
        _run_mutmut(work, args.max_children, globs, dict(module.env))
    mutants = _collect(work, module)
    if not mutants:
        print(f"tools/mutate.py: no results in {work}/mutants; run without --report-only")
        return 1
    out = REPO / "docs" / "mutation" / f"{args.module}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_report(args.module, module, mutants))
    print(f"tools/mutate.py: wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
