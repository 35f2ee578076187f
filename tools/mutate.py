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


@dataclass(frozen=True)
class Module:
    files: tuple[str, ...]  # globs, relative to the repository
    tests: tuple[str, ...]  # pytest paths or node ids (file::test)


# The contract's critical paths (the issue on mutation testing). Dotted names are one file of a
# module with its own tests: quicker runs while working on that file.
MODULES = {
    "formats": Module(("mxrl/formats/*.py",), ("tests/formats",)),
    "recipe": Module(
        ("mxrl/recipe/plan.py", "mxrl/recipe/schema.py", "mxrl/recipe/layers.py",
         "mxrl/arch/names.py", "mxrl/recipe/quantize.py", "mxrl/arch/hf.py"),
        ("tests/recipe", "tests/arch", "tests/test_cli.py"),
    ),
    "nn": Module(
        ("mxrl/nn/qlinear.py", "mxrl/nn/qmatmul.py", "mxrl/nn/gemm.py", "mxrl/nn/grouped.py",
         "mxrl/nn/experts.py", "mxrl/nn/apply.py"),
        ("tests/nn",),
    ),
    "weights": Module(("mxrl/weights/*.py",), ("tests/weights",)),
    "sync": Module(("mxrl/sync/*.py",), ("tests/sync",)),
    "engine": Module(
        ("mxrl/engine/block_manager.py", "mxrl/engine/scheduler.py", "mxrl/engine/sampler.py",
         "mxrl/engine/graph.py", "mxrl/engine/loading.py"),
        ("tests/engine",),
    ),
    # node ids: test_scheduler.py's block-manager tests, not its engine runs (minutes each on
    # two shared cores, run on every mutant they reach; `make test` runs them)
    "engine.block_manager": Module(
        ("mxrl/engine/block_manager.py",),
        ("tests/engine/test_block_manager.py",
         "tests/engine/test_scheduler.py::test_blocks_are_counted_shared_and_reused_until_handed_out_again",
         "tests/engine/test_scheduler.py::test_a_cached_block_taken_back_leaves_the_free_order_of_the_rest_alone",
         "tests/engine/test_scheduler.py::test_taking_back_cached_blocks_does_not_scan_the_free_list",
         "tests/engine/test_block_manager_edges.py"),
    ),
    # node ids: the file's tests but the 4000-request frequency test (48 s on two shared cores,
    # row by row on the CPU; the race test holds each draw to the spec, request by request)
    "engine.sampler": Module(
        ("mxrl/engine/sampler.py",),
        ("tests/engine/test_sampler.py::test_noise_is_exact_integer_arithmetic",
         "tests/engine/test_sampler.py::test_noise_is_uniform_and_rows_differ",
         "tests/engine/test_sampler.py::test_each_draw_is_the_race_of_its_own_noise",
         "tests/engine/test_sampler.py::test_top_k_and_top_p_keep_the_hand_computed_sets",
         "tests/engine/test_sampler.py::test_filters_on_random_rows_keep_the_spec_sets",
         "tests/engine/test_sampler.py::test_a_row_does_not_depend_on_its_batch",
         "tests/engine/test_sampler.py::test_top_k_keeps_the_k_largest",
         "tests/engine/test_sampler_edges.py"),
    ),
    "parallel": Module(("mxrl/parallel/export.py", "mxrl/parallel/dcp.py"),
                       ("tests/parallel",)),
    "rl": Module(
        ("mxrl/rl/grpo.py", "mxrl/rl/mismatch.py", "mxrl/rl/stability.py", "mxrl/rl/logprobs.py"),
        ("tests/rl",),
    ),
    "rl.grpo": Module(("mxrl/rl/grpo.py",), ("tests/rl/test_grpo.py", "tests/rl/test_grpo_edges.py")),
    "rl.logprobs": Module(
        ("mxrl/rl/logprobs.py",), ("tests/rl/test_logprobs.py", "tests/rl/test_logprobs_edges.py")
    ),
    # node ids: the file's tests but its trainer step (a minute a mutant) and its GPU test
    "rl.micro_batch": Module(
        ("mxrl/rl/micro_batch.py",),
        ("tests/rl/test_micro_batch.py::test_split_cuts_in_request_order_by_padded_tokens",
         "tests/rl/test_micro_batch.py::test_every_rank_runs_as_many_forwards",
         "tests/rl/test_micro_batch.py::test_combine_sums_maxima_and_token_weighted_means",
         "tests/rl/test_micro_batch.py::test_policy_loss_of_micro_batches_adds_up_to_the_whole_batch",
         "tests/rl/test_micro_batch_edges.py"),
    ),
    # the train-rollout mismatch metrics (k1, k3, |d|) and the gradient-spike detector
    "rl.mismatch": Module(
        ("mxrl/rl/mismatch.py",), ("tests/rl/test_mismatch.py", "tests/rl/test_mismatch_edges.py")
    ),
    "rl.stability": Module(
        ("mxrl/rl/stability.py",),
        ("tests/rl/test_stability.py", "tests/rl/test_stability_edges.py"),
    ),
    # the served-checkpoint export (`mxrl convert --to hf`) and its config.json
    "weights.served": Module(
        ("mxrl/weights/served.py", "mxrl/weights/served_config.py"),
        ("tests/weights/test_served.py", "tests/weights/test_served_edges.py",
         "tests/weights/test_served_config.py"),
    ),
    # the record checksum (name, header, every field's digest) and the weights digest; node ids:
    # test_digest.py but its export test (a tiny model exported, 3 s a mutant: export.py's use
    # of checksum, not the checksum) and its GPU tests (skipped on the CPU)
    "weights.digest": Module(
        ("mxrl/weights/digest.py",),
        ("tests/weights/test_digest.py::test_any_flipped_bit_changes_the_checksum",
         "tests/weights/test_digest.py::test_reordered_rows_bytes_and_experts_change_it",
         "tests/weights/test_digest.py::test_dtype_shape_and_length_are_bound",
         "tests/weights/test_digest.py::test_every_byte_of_every_field_of_every_format_counts",
         "tests/weights/test_digest.py::test_the_name_is_bound",
         "tests/weights/test_digest.py::test_the_gemm_and_the_elementwise_path_give_the_same_integers",
         "tests/weights/test_digest.py::test_checksums_of_many_equal_one_by_one",
         "tests/weights/test_digest_edges.py"),
    ),
    # the bucketed live export (boundaries, exact fits, oversize records, the event)
    "weights.buckets": Module(
        ("mxrl/weights/buckets.py",),
        ("tests/weights/test_buckets.py", "tests/sync/test_export.py",
         "tests/weights/test_buckets_edges.py"),
    ),
    # the checks of a record against the plan (fields, global scales, a checkpoint's config);
    # not test_checkpoint_checks.py (a converted checkpoint and an engine loading it, seconds a
    # mutant): check_config's refusals are called directly by test_check_edges.py
    "weights.check": Module(
        ("mxrl/weights/check.py",),
        ("tests/weights/test_check.py", "tests/weights/test_check_edges.py"),
    ),
    # routing replay lives in the model code (forward under checkpointing, the router)
    "models": Module(("mxrl/models/model.py", "mxrl/models/layers.py"), ("tests/models",)),
}  # fmt: skip


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
    text += f"""
[tool.mutmut]
source_paths = ["mxrl"]
only_mutate = {_toml_list(module.files)}
pytest_add_cli_args_test_selection = {_toml_list(module.tests)}
pytest_add_cli_args = ["-p", "no:cacheprovider", "-m", "not triton"]
# docs and benchmarks: tests read them (doc hashes, benchmark scripts)
also_copy = ["README.md", "docs", "benchmarks", "Makefile"]
# torch is not fork-safe after it ran a test: workers fork from a process that only imported
process_isolation = "forkserver"
# out of scope: the wording of refusals and logs (every condition that raises is mutated)
do_not_mutate_patterns = {_toml_list(DO_NOT_MUTATE)}
"""
    (work / "pyproject.toml").write_text(text)


def _run_mutmut(work: Path, max_children: int, names: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
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
        f"tests: {', '.join(f'`{t}`' for t in module.tests)}. How to read and refresh this: "
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
        _run_mutmut(work, args.max_children, args.mutant)
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
