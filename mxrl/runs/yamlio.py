"""The one YAML loader of mxrl: train configs, recipes and run records all read YAML through it.

    data = load_yaml(Path("train.yaml"))       # or load_yaml(text, "train.yaml")

PyYAML's `safe_load` with two differences, both to stop a file from meaning something else than
it says without a word:

- **a duplicate key is an error** (PyYAML keeps the last value silently): `lr` given twice in one
  mapping names both lines;
- **`1e-4`, `5e-4`, `1E6`, `2.5e3` are floats**, as in YAML 1.2 and every JSON reader. PyYAML
  follows YAML 1.1, whose floats need a dot and a signed exponent (`1.0e-4`), and reads `5e-4`
  as the *string* "5e-4" — a learning rate that would fail deep inside the optimizer.

`dump_yaml` writes what `load_yaml` reads back unchanged (it quotes a string such as "5e-4").

Errors are ValueError on one line: the file, the line, what is wrong.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

__all__ = ["dump_yaml", "load_yaml"]

# YAML 1.2 core-schema floats that YAML 1.1 misses: an exponent without a dot or without a sign
# (the 1.1 forms, `1.0e-4`, are already floats and are left to PyYAML's own resolver)
_FLOAT_12 = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader + YAML 1.2 exponent floats + duplicate keys refused."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: keys written here override the merged ones, by design
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeConstructor reports it
                continue
            if first is not None:
                raise _DuplicateKey(
                    None,
                    None,
                    f"duplicate key {key!r} (first on line {first}); a mapping holds each key "
                    "once: delete one of them",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that knows `load_yaml`'s floats, so it quotes the *string* "5e-4"."""


for _cls in (_StrictLoader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def load_yaml(source: str | Path, name: str | None = None) -> Any:
    """The YAML document in `source` (a Path is read; a str is the text, `name` labels errors).
    ValueError, on one line, for an unreadable file, invalid YAML or a duplicate key."""
    if isinstance(source, Path):
        name = name or str(source)
        try:
            text = source.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(f"{name}: cannot read it: {reason}") from None
    else:
        text = source
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no object tags
    except yaml.YAMLError as e:
        raise ValueError(f"{name or '<yaml>'}: {_one_line(e)}") from None


def dump_yaml(data: Any) -> str:
    """YAML text that `load_yaml` reads back as `data` (plain types), keys in their order."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True)


def _one_line(e: yaml.YAMLError) -> str:
    """`line N: problem` from a PyYAML error (its text spans several lines)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is not None and problem:
        context = getattr(e, "context", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}"
        if isinstance(e, _DuplicateKey):
            return f"line {mark.line + 1}: {problem}"
        return f"{where}: not valid YAML: {f'{context}: ' if context else ''}{problem}"
    return "not valid YAML: " + " ".join(str(e).split())
