"""Recipe parsing and validation: every error names the offending thing and where it is."""

from __future__ import annotations

import pytest

from mxrl.arch import Kind
from mxrl.formats.constants import Format
from mxrl.recipe import Backward, Match, Recipe, Rule, list_presets, load_recipe

PRESETS = [
    "bf16",
    "fp8-block",
    "fp8-block-quantized",
    "mxfp8",
    "mxfp8-dequantized",
    "mxfp8-hp",
    "nvfp4-4over6-hp",
    "nvfp4-dequantized",
    "nvfp4-hp",
]


def _recipe(*rules, **top):
    return {
        "name": "t",
        "backward": "high_precision",
        "default": "bf16",
        "rules": list(rules),
        **top,
    }


def _error(data) -> str:
    with pytest.raises(ValueError) as err:
        load_recipe(data)
    return str(err.value)


def test_presets_listed_and_loadable():
    assert list_presets() == PRESETS
    for name in PRESETS:
        recipe = load_recipe(name)
        assert recipe.name == name
        assert recipe.description


def test_preset_backward_modes():
    backward = {name: load_recipe(name).backward for name in PRESETS}
    assert backward == {
        "bf16": Backward.HIGH_PRECISION,
        "fp8-block": Backward.HIGH_PRECISION,
        "fp8-block-quantized": Backward.QUANTIZED,
        "mxfp8": Backward.QUANTIZED,
        "mxfp8-dequantized": Backward.DEQUANTIZED,
        "mxfp8-hp": Backward.HIGH_PRECISION,
        "nvfp4-4over6-hp": Backward.HIGH_PRECISION,
        "nvfp4-dequantized": Backward.DEQUANTIZED,
        "nvfp4-hp": Backward.HIGH_PRECISION,
    }


def test_design_doc_example_parses():
    recipe = load_recipe(
        _recipe(
            {"match": {"layers": "last 15%"}, "format": "bf16"},
            {"match": {"kind": "shared_expert"}, "format": "bf16"},
            {
                "match": {"kind": "routed_expert"},
                "format": "nvfp4",
                "activations": "per_token",
                "fuse": ["gate", "up"],
            },
            name="nvfp4-dequantized",
            backward="dequantized",
        )
    )
    last = recipe.rules[2]
    assert last.format is Format.NVFP4 and last.activations == "per_token"
    assert last.fuse == ("gate", "up")
    assert last.match.kind == (Kind.ROUTED_EXPERT,)
    assert recipe.rules[0].match.layers.indices(48) == frozenset(range(40, 48))


def test_defaults_and_normalisation():
    recipe = load_recipe(
        {
            "name": "x",
            "rules": [
                {"match": {"kind": ["router", "mla"], "name": "*.q_proj.*"}, "format": "nvfp4"},
                {"format": "fp8_block"},
            ],
        }
    )
    assert recipe.backward is Backward.HIGH_PRECISION and recipe.default is Format.BF16
    assert recipe.rules[0].activations == "per_token"  # nvfp4 default
    assert recipe.rules[0].match.name == ("*.q_proj.*",)
    assert recipe.rules[0].match.kind == (Kind.ROUTER, Kind.MLA)
    assert recipe.rules[1].block == (128, 128)
    assert recipe.rules[1].match == Match()  # no selector: matches everything
    assert Rule(format="fp8_block", block=[64, 64]).block == (64, 64)


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        (
            _recipe(colour="red"),
            ["'colour'", "name, description, backward, default, kv_cache, rules"],
        ),
        (_recipe({"format": "bf16", "when": {}}), ["rules[0]", "'when'", "match, format"]),
        (
            _recipe({"format": "bf16"}, {"match": {"kinds": "router"}, "format": "bf16"}),
            ["rules[1] match", "'kinds'", "name, kind, layers"],
        ),
        (
            _recipe({"match": {"kind": "expert"}, "format": "bf16"}),
            ["rules[0]", "match.kind", "'expert'", "routed_expert"],
        ),
        (
            _recipe({"match": {"kind": "router"}, "format": "fp4"}),
            ["rules[0]", "format", "'fp4'", "nvfp4"],
        ),
        (
            _recipe({"match": {"layers": "last fifteen%"}, "format": "bf16"}),
            ["rules[0]", "layers", "'last fifteen%'", "last P%"],
        ),
        (_recipe({"match": {"layers": "9-2"}, "format": "bf16"}), ["rules[0]", "'2-9'"]),
        (
            _recipe(
                {"match": {"kind": "attention"}, "format": "mxfp8", "activations": "per_token"}
            ),
            ["rules[0]", "activations", "nvfp4", "remove 'activations'"],
        ),
        (
            _recipe({"format": "nvfp4", "activations": "per_block"}),
            ["rules[0]", "activations", "'per_block'", "per_token, per_tensor"],
        ),
        (
            _recipe({"format": "nvfp4", "fuse": ["gate", "down"]}),
            ["rules[0]", "fuse", "[gate, up]"],
        ),
        (
            _recipe({"format": "mxfp8", "fuse": ["gate", "up"]}),
            ["rules[0]", "fuse", "mxfp8", "format: nvfp4"],
        ),
        (_recipe({"format": "mxfp8", "block": [32, 32]}), ["rules[0]", "block", "fp8_block"]),
        (
            _recipe({"format": "nvfp4", "scale_mode": "4/6"}),
            ["rules[0]", "scale_mode", "'4/6'", "te, 4over6"],
        ),
        (
            _recipe({"format": "nvfp4", "scale_mode": "torchao"}),
            ["rules[0]", "scale_mode", "'torchao'", "te, 4over6"],
        ),
        (
            _recipe({"format": "mxfp8", "scale_mode": "4over6"}),
            ["rules[0]", "scale_mode", "only nvfp4", "mxfp8", "format: nvfp4"],
        ),
        (_recipe({"format": "fp8_block", "block": [1, 128]}), ["rules[0]", "block", "[128, 128]"]),
        (_recipe({"match": {"kind": "router"}}), ["rules[0]", "missing 'format'"]),
        (_recipe({"match": {"name": []}, "format": "bf16"}), ["rules[0]", "match.name"]),
        (_recipe({"match": "router", "format": "bf16"}), ["rules[0]", "match"]),
        (_recipe(backward="fp4"), ["backward", "'fp4'", "high_precision, dequantized, quantized"]),
        (_recipe(default="int8"), ["default", "'int8'", "bf16, mxfp8, nvfp4, fp8_block"]),
        (_recipe(rules="all"), ["rules", "list"]),
        (_recipe(name=""), ["name"]),
    ],
)
def test_validation_errors_name_the_culprit(data, needles):
    msg = _error(data)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_nvfp4_scale_mode_4over6_and_the_default_spelled_out():
    """4over6 is kept; `te` (the default written out) is stored as no key, so that a recipe
    that spells it hashes as one that does not."""
    rule = {"match": {"kind": "routed_expert"}, "format": "nvfp4"}
    four = load_recipe(_recipe({**rule, "scale_mode": "4over6"}))
    assert four.rules[0].scale_mode == "4over6"
    assert load_recipe(_recipe({**rule, "scale_mode": "te"})).rules[0].scale_mode is None
    assert load_recipe(_recipe(rule)).rules[0].scale_mode is None
    preset = load_recipe("nvfp4-4over6-hp")
    hp = load_recipe("nvfp4-hp")
    assert preset.rules[-1].scale_mode == "4over6"
    assert preset.rules[:-1] == hp.rules[:-1]
    assert preset.rules[-1] == Rule(**{**vars(hp.rules[-1]), "scale_mode": "4over6"})


def test_backward_quantized_is_mxfp8_and_block_fp8_only():
    msg = _error(
        _recipe({"match": {"kind": "routed_expert"}, "format": "nvfp4"}, backward="quantized")
    )
    assert "quantized" in msg and "rules[0]" in msg and "nvfp4" in msg and "dequantized" in msg
    assert "default" in _error(_recipe(backward="quantized", default="nvfp4"))
    for fmt in ("mxfp8", "fp8_block"):
        ok = load_recipe(_recipe({"format": fmt}, backward="quantized"))
        assert ok.backward is Backward.QUANTIZED
    with pytest.raises(ValueError, match="backward"):
        Recipe(name="x", backward="quantized", rules=(Rule(format="nvfp4"),))


def test_load_from_yaml_file(tmp_path):
    path = tmp_path / "my-recipe.yaml"
    path.write_text(
        "# a comment\nbackward: dequantized\nrules:\n"
        "  - match: {kind: routed_expert, layers: '0-3'}\n    format: mxfp8\n"
    )
    recipe = load_recipe(path)
    assert recipe.name == "my-recipe"  # the file stem when the YAML has no name
    assert recipe.rules[0].match.describe() == "{kind: routed_expert, layers: 0-3}"
    assert load_recipe(str(path)) == recipe


def test_load_errors(tmp_path):
    assert "no such preset or file" in _error("nvfp4-fast")
    assert "nvfp4-dequantized" in _error("nvfp4-fast")  # lists the presets
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules: [\n")
    assert "not valid YAML" in _error(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert "empty" in _error(empty)
    listed = tmp_path / "list.yaml"
    listed.write_text("- format: bf16\n")
    assert "mapping" in _error(listed)
    typo = tmp_path / "typo.yaml"
    typo.write_text("name: typo\nrules:\n  - match: {kind: router}\n    formt: bf16\n")
    msg = _error(typo)
    assert "'typo'" in msg and "rules[0]" in msg and "'formt'" in msg
    with pytest.raises(TypeError):
        load_recipe(42)


def test_describe():
    rule = Rule(match=Match(name=["*.q_proj.*", "*.k_proj.*"], kind="attention", layers="0-3"))
    assert (
        rule.describe(2)
        == "rules[2] {name: [*.q_proj.*, *.k_proj.*], kind: attention, layers: 0-3}"
    )
    assert Rule().describe(0) == "rules[0] {}"
