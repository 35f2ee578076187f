"""The one YAML loader: YAML 1.2 exponent floats, duplicate keys refused, one-line errors."""

from __future__ import annotations

import pytest

from mxrl.recipe import load_recipe
from mxrl.runs.yamlio import dump_yaml, load_yaml


def test_exponent_floats_without_a_dot_or_a_sign_are_floats():
    # YAML 1.1 (PyYAML's safe_load) reads 5e-4 and 1e4 as strings; YAML 1.2 and JSON as floats
    got = load_yaml("a: 5e-4\nb: 1e4\nc: 1.0e-4\nd: 1.5E+3\ne: .5e-1\nf: -2e-3\n")
    assert got == {"a": 0.0005, "b": 10000.0, "c": 0.0001, "d": 1500.0, "e": 0.05, "f": -0.002}
    assert all(type(v) is float for v in got.values())


def test_other_scalars_keep_their_yaml_types():
    got = load_yaml("i: 5\nu: 1_000\nq: '5e-4'\nw: 1e\nn: null\nt: true\ninf: .inf\n")
    assert got == {"i": 5, "u": 1000, "q": "5e-4", "w": "1e", "n": None, "t": True,
                   "inf": float("inf")}  # fmt: skip
    assert type(got["i"]) is int


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [("a: 1\na: 2\n", 2, "'a'"), ("rl:\n  lr: 1\n  steps: 2\n  lr: 3\n", 4, "'lr'")],
)
def test_a_duplicate_key_names_its_lines(text, line, key):
    with pytest.raises(ValueError) as err:
        load_yaml(text, "t.yaml")
    msg = str(err.value)
    assert msg.startswith(f"t.yaml: line {line}: duplicate key {key}") and "\n" not in msg


def test_merge_keys_may_be_overridden():
    assert load_yaml("x: &b {p: 1, q: 1}\ny:\n  <<: *b\n  p: 2\n")["y"] == {"p": 2, "q": 1}


def test_invalid_yaml_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("a: [\n")
    with pytest.raises(ValueError, match=r"bad.yaml'?: line 2, column 1: not valid YAML") as err:
        load_yaml(path)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="cannot read"):
        load_yaml(tmp_path / "missing.yaml")


def test_a_recipe_with_a_duplicate_key_is_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("name: dup\ndefault: bf16\nrules: []\ndefault: mxfp8\n")
    with pytest.raises(ValueError, match=r"dup.yaml'?: line 4: duplicate key 'default'"):
        load_recipe(path)


def test_dump_quotes_what_would_read_back_as_a_float():
    data = {"s": "5e-4", "t": "1e3", "f": 5e-4, "i": 3, "n": None, "l": ["x", 1.5]}
    text = dump_yaml(data)
    assert "s: '5e-4'" in text and "t: '1e3'" in text
    assert load_yaml(text) == data
