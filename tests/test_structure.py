"""The package's shape, measured with `ast` (docs/redesign-plan.md §1, §5; docs/design.md §4.2).

Each check holds today's exceptions as an explicit baseline list. A check fails on a violation
that is not listed, and on a listed one that is gone, so the lists stay true: a commit that fixes
an exception strikes it from its list in the same commit. The redesign ends with every list empty.

- imports run downhill: no module imports a room later in `ROOMS`;
- no import circle spans two folders (function-local imports count);
- no module imports a name another module of mxrl keeps private (`_name`);
- no file over 400 lines, no function over 80 lines outside a `@triton.jit` kernel;
- one class under `rl/` whose name ends in `Trainer`.
"""

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mxrl"

# The rooms in import order: a module may import only from its own room and the rooms before it.
# `mxrl/cli.py` is the room `cli`; `mxrl/__init__.py` (the package's door) is in none.
ROOMS = [
    "formats",
    "runs",
    "arch",
    "recipe",
    "kernels",
    "nn",
    "models",
    "weights",
    "engine",
    "sync",
    "parallel",
    "rl",
    "app",
    "cli",
]

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80

# (importer, imported module): imports of a later room.
UPWARD_BASELINE: set[tuple[str, str]] = set()

# The modules of each import circle that spans two folders.
CIRCLE_BASELINE: set[tuple[str, ...]] = set()

# (importer, module, name): private names imported from another module of mxrl.
PRIVATE_BASELINE: set[tuple[str, str, str]] = set()

# Files over MAX_FILE_LINES, relative to mxrl/ (by path, not by length: a listed file may change).
LONG_FILE_BASELINE: set[str] = set()

# (file, qualified name): functions over MAX_FUNCTION_LINES, counted from the `def` or its first
# decorator to the last line, docstring included.
LONG_FUNCTION_BASELINE: set[tuple[str, str]] = set()

TRAINER_BASELINE = {"GRPOTrainer"}


@dataclass(frozen=True)
class Module:
    name: str  # "mxrl.kernels.rowwise"
    path: Path
    tree: ast.Module

    @property
    def package(self) -> str:
        return self.name if self.path.name == "__init__.py" else self.name.rsplit(".", 1)[0]

    @property
    def rel(self) -> str:
        return self.path.relative_to(PACKAGE).as_posix()


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # the module imported from, resolved to an absolute name
    names: tuple[str, ...]  # the names of `from module import ...`; () for `import module`


def _modules() -> dict[str, Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        out[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return out


MODULES = _modules()


def _imports(module: Module) -> Iterator[Import]:
    """Every import statement of mxrl's own modules, function-local ones included."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mxrl."):
                    yield Import(node.lineno, alias.name, ())
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: `from .x import y` inside the package
                parts = module.package.split(".")
                base = parts[: len(parts) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            if target == "mxrl" or target.startswith("mxrl."):
                yield Import(node.lineno, target, tuple(a.name for a in node.names))


def _edges(module: Module) -> set[str]:
    """The modules this one imports: `from mxrl.kernels import rowwise` imports the submodule."""
    out = set()
    for imp in _imports(module):
        subs = [f"{imp.module}.{n}" for n in imp.names if f"{imp.module}.{n}" in MODULES]
        out.update(subs)
        if len(subs) < len(imp.names) or not imp.names:
            out.add(imp.module)
    return out & MODULES.keys()


def room(name: str) -> str | None:
    """`mxrl.kernels.rowwise` -> `kernels`; `mxrl.cli` -> `cli`; `mxrl` -> None."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def folder(name: str) -> str:
    module = MODULES[name]
    return module.path.parent.relative_to(PACKAGE.parent).as_posix()


def _check(found: set, baseline: set, what: str) -> None:
    new = sorted(found - baseline)
    gone = sorted(baseline - found)
    assert not new, f"{what}: not allowed (docs/design.md §4): {new}"
    assert not gone, f"{what}: fixed, strike them from the baseline list in this file: {gone}"


def upward_imports() -> set[tuple[str, str]]:
    found = set()
    for module in MODULES.values():
        here = room(module.name)
        for target in _edges(module):
            there = room(target)
            if here is None or there is None or here == there:
                continue
            if ROOMS.index(there) > ROOMS.index(here):
                found.add((module.name, target))
    return found


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (the graph is small; recursion depth is not the point)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    out.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def circles_across_folders() -> set[tuple[str, ...]]:
    graph = {name: _edges(module) for name, module in MODULES.items()}
    return {
        tuple(sorted(c))
        for c in _strongly_connected(graph)
        if len({folder(name) for name in c}) > 1
    }


def private_imports() -> set[tuple[str, str, str]]:
    found = set()
    for module in MODULES.values():
        for imp in _imports(module):
            if imp.module == module.name:
                continue
            for name in imp.names:
                if name.startswith("_") and not name.startswith("__"):
                    found.add((module.name, imp.module, name))
    return found


def long_files() -> set[str]:
    return {
        m.rel for m in MODULES.values() if len(m.path.read_text().splitlines()) > MAX_FILE_LINES
    }


def _functions(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.AST]]:
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from _functions(node.body, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node.body, f"{prefix}{node.name}.")
        elif hasattr(node, "body"):  # if / try / with blocks at any level
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _functions(getattr(node, field, []), prefix)


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("triton" in ast.unparse(d) for d in node.decorator_list)


def long_functions() -> set[tuple[str, str]]:
    found = set()
    for module in MODULES.values():
        for qualname, node in _functions(module.tree.body, ""):
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            if node.end_lineno - first + 1 > MAX_FUNCTION_LINES and not _is_triton_kernel(node):
                found.add((module.rel, qualname))
    return found


def trainer_classes() -> set[str]:
    return {
        node.name
        for module in MODULES.values()
        if room(module.name) == "rl"
        for node in ast.walk(module.tree)
        if isinstance(node, ast.ClassDef) and node.name.endswith("Trainer")
    }


def test_every_module_is_in_a_room():
    rooms = {room(name) for name in MODULES} - {None}
    assert rooms <= set(ROOMS), f"rooms missing from ROOMS: {sorted(rooms - set(ROOMS))}"


def test_imports_run_downhill():
    _check(upward_imports(), UPWARD_BASELINE, "imports of a later room")


def test_no_import_circle_spans_two_folders():
    _check(circles_across_folders(), CIRCLE_BASELINE, "import circles across folders")


def test_no_private_name_crosses_a_module():
    _check(private_imports(), PRIVATE_BASELINE, "private names imported from another module")


def test_files_are_short():
    _check(long_files(), LONG_FILE_BASELINE, f"files over {MAX_FILE_LINES} lines")


def test_functions_are_short():
    _check(long_functions(), LONG_FUNCTION_BASELINE, f"functions over {MAX_FUNCTION_LINES} lines")


def test_one_trainer():
    _check(trainer_classes(), TRAINER_BASELINE, "trainer classes under rl/")


def test_the_checks_see_what_they_check():
    # a check that reads nothing passes vacuously: the measures see the package and resolve imports
    assert len(MODULES) > 100
    assert {"mxrl.formats.codecs", "mxrl.formats.qtensor"} <= _edges(MODULES["mxrl.formats.api"])
    assert "mxrl.formats.constants" in _edges(MODULES["mxrl.nn.qlinear"])
    assert room("mxrl.cli") == "cli" and room("mxrl") is None
    circles = _strongly_connected({"a": {"b"}, "b": {"a", "c"}, "c": set()})
    assert sorted(map(sorted, circles)) == [["a", "b"], ["c"]]
