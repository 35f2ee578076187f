"""resolve edges the mutation run of `recipe.plan` found unheld (docs/mutation/recipe.plan.md):
num_layers at its bounds, the default format's options, each block along K (the block's
second entry, the last dim), gate/up groups with one half missing or one half unfused, and each
kind of problem, counted, on a small hand-listed model (docs/recipes.md is the spec)."""

from __future__ import annotations

import pytest

from mxrl.formats.constants import Format
from mxrl.recipe import resolve

EMB, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"
GATE0, UP0, DOWN0 = (
    f"model.layers.0.mlp.experts.0.{r}_proj.weight" for r in ("gate", "up", "down")
)
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"
# one decoder layer of attention and one expert, the embeddings, a norm
SMALL = {EMB: (64, 64), Q0: (64, 64), GATE0: (32, 64), UP0: (32, 64), DOWN0: (64, 32),
         "model.layers.0.input_layernorm.weight": (64,), NORM: (64,), HEAD: (64, 64)}  # fmt: skip


def _recipe(*rules, default="bf16", **kw):
    return {"name": "probe", "default": default, "rules": list(rules), **kw}


def test_num_layers_is_the_last_layer_plus_one_or_zero_without_layers():
    assert resolve(_recipe(), SMALL).num_layers == 1
    assert (
        resolve(_recipe(), {**SMALL, "model.layers.5.input_layernorm.weight": (64,)}).num_layers
        == 6
    )
    assert resolve(_recipe(), {EMB: (64, 64), HEAD: (64, 64)}).num_layers == 0
    assert resolve(_recipe(), {EMB: (64, 64)}, num_layers=3).num_layers == 3
    assert resolve(_recipe(), {EMB: (64, 64)}, num_layers=0).num_layers == 0


def test_num_layers_must_pass_the_last_layer():
    assert resolve(_recipe(), SMALL, num_layers=2).num_layers == 2
    assert resolve(_recipe(), SMALL, num_layers=1).num_layers == 1
    with pytest.raises(ValueError, match="num_layers=0 but the tensors reach layer 0"):
        resolve(_recipe(), SMALL, num_layers=0)


def test_a_layers_selector_counts_from_num_layers():
    """ "last 50%" of 2 layers is layer 1; of 4 layers, layers 2 and 3: layer 0 stays default."""
    rule = {"match": {"layers": "last 50%"}, "format": "mxfp8"}
    assert resolve(_recipe(rule), SMALL, num_layers=1)[Q0].format is Format.MXFP8
    assert resolve(_recipe(rule), SMALL, num_layers=4)[Q0].format is Format.BF16


def test_the_default_format_carries_its_options():
    """An nvfp4 default: per_token activations (docs: the default), no fuse group (fuse is a
    rule's option); an fp8_block default: the [128, 128] block."""
    nv = resolve(_recipe(default="nvfp4"), SMALL)
    for name in (EMB, Q0, GATE0, UP0, DOWN0, HEAD):
        spec = nv[name]
        assert (spec.format, spec.activations, spec.fuse_group, spec.block, spec.rule,
                spec.scale_mode) == (Format.NVFP4, "per_token", None, None, "default", None)  # fmt: skip
    assert nv[NORM].format is Format.BF16 and nv[NORM].rule == "not a matmul weight"
    wide = {EMB: (256, 128), Q0: (128, 128), HEAD: (256, 128)}
    fp8 = resolve(_recipe(default="fp8_block"), wide)
    assert all(s.block == (128, 128) and s.activations is None for s in fp8.values())
    assert fp8.problems == ()


def test_a_rule_passes_its_options_and_provenance():
    rule = {"match": {"kind": "routed_expert"}, "format": "nvfp4", "activations": "per_tensor",
            "fuse": ["gate", "up"], "scale_mode": "4over6"}  # fmt: skip
    plan = resolve(_recipe(rule), SMALL)
    g, u, d = plan[GATE0], plan[UP0], plan[DOWN0]
    group = "model.layers.0.mlp.experts.0.gate_up"
    assert (g.activations, g.fuse_group, g.scale_mode) == ("per_tensor", group, "4over6")
    assert (u.activations, u.fuse_group, u.scale_mode) == ("per_tensor", group, "4over6")
    assert (d.activations, d.fuse_group, d.scale_mode) == ("per_tensor", None, "4over6")
    assert g.rule == "rules[0] {kind: routed_expert}"
    assert (g.kind.value, g.layer, g.expert, g.role) == ("routed_expert", 0, 0, "gate")
    assert plan[Q0].format is Format.BF16 and plan[Q0].rule == "default"
    unfused = resolve(_recipe({k: v for k, v in rule.items() if k != "fuse"}), SMALL)
    assert unfused[GATE0].fuse_group is None and unfused[UP0].fuse_group is None


def test_the_block_that_counts_is_along_k_the_last_dim():
    """fp8_block's (square) block must divide K, the last dim; the rows may pass the tensor's
    (the last block is partial). mxfp8: 32 along K, nvfp4: 16."""
    tall = {Q0: (64, 96)}  # K = 96
    b32 = {"match": {"kind": "attention"}, "format": "fp8_block", "block": [32, 32]}
    assert resolve(_recipe(b32), tall)[Q0].block == (32, 32)
    assert resolve(_recipe(b32), {Q0: (40, 96)})[Q0].block == (32, 32)  # 40 rows: fine
    b64 = {**b32, "block": [64, 64]}
    with pytest.raises(ValueError, match=r"\(64, 96\) cannot be fp8_block.*\(64\)"):
        resolve(_recipe(b64), tall)
    assert resolve(_recipe(b64), {Q0: (96, 64)})[Q0].block == (64, 64)
    assert resolve(_recipe(default="mxfp8"), tall)[Q0].format is Format.MXFP8  # 96 = 3 x 32
    assert resolve(_recipe(default="nvfp4"), {Q0: (64, 48)})[Q0].format is Format.NVFP4
    with pytest.raises(ValueError, match=r"\(64, 48\) cannot be mxfp8.*\(32\)"):
        resolve(_recipe(default="mxfp8"), {Q0: (64, 48)})
    with pytest.raises(ValueError, match=r"\(32, 40\) cannot be nvfp4.*\(16\)"):
        resolve(_recipe(default="nvfp4"), {Q0: (32, 40)})
    # rows that fit no block are fine: only K is blocked
    assert resolve(_recipe(default="mxfp8"), {Q0: (48, 64)})[Q0].format is Format.MXFP8
    # bf16 has no block
    assert resolve(_recipe(), {Q0: (7, 5)})[Q0].format is Format.BF16


def test_a_fused_gate_up_tensor_is_its_own_group():
    fused = {GATE_UP: (4, 64, 64), "model.layers.1.mlp.experts.down_proj": (4, 64, 32)}
    rule = {"match": {"kind": "routed_expert"}, "format": "nvfp4", "fuse": ["gate", "up"]}
    plan = resolve(_recipe(rule), fused)
    assert plan[GATE_UP].fuse_group == GATE_UP
    # a fused group, alone and fine, does not end the check of the groups after it
    only_gate = {**rule, "match": {"name": ["*.gate_proj.weight", "*.gate_up_proj"]}}
    rest = {"match": {"kind": "routed_expert"}, "format": "nvfp4"}
    with pytest.raises(ValueError, match=r"needs .*experts.0.gate_proj.* in one format"):
        resolve(_recipe(only_gate, rest), {**fused, GATE0: (32, 64), UP0: (32, 64)})


def test_a_3d_expert_tensor_is_blocked_along_its_last_dim():
    """[E, 2I, H] and [E, H, I]: K is the last dim, not the second (mxfp8: 32 along K)."""
    down = "model.layers.1.mlp.experts.down_proj"
    plan = resolve(_recipe(default="mxfp8"), {GATE_UP: (4, 48, 64), down: (4, 80, 32)})
    assert plan[GATE_UP].format is Format.MXFP8 and plan[down].format is Format.MXFP8
    with pytest.raises(ValueError, match=r"\(4, 64, 48\) cannot be mxfp8"):
        resolve(_recipe(default="mxfp8"), {GATE_UP: (4, 64, 48)})


def test_a_group_with_one_half_fused_names_both_and_says_not_fused():
    only_gate = {"match": {"name": "*.gate_proj.weight"}, "format": "nvfp4",
                 "fuse": ["gate", "up"]}  # fmt: skip
    rest = {"match": {"kind": "routed_expert"}, "format": "nvfp4"}
    with pytest.raises(ValueError) as err:
        resolve(_recipe(only_gate, rest), SMALL)
    msg = str(err.value)
    assert f"needs {GATE0!r} and {UP0!r} in one format" in msg
    assert "resolved to nvfp4 per_token fused (rules[0] {name: *.gate_proj.weight}) and " in msg
    assert "nvfp4 per_token not fused (rules[1] {kind: routed_expert})" in msg


@pytest.mark.parametrize("field", [{"activations": "per_tensor"}, {"scale_mode": "4over6"}])
def test_fused_halves_must_agree_on_each_option(field):
    fuse = {"format": "nvfp4", "fuse": ["gate", "up"]}
    up = {"match": {"name": "*.up_proj.weight"}, **fuse, **field}
    rest = {"match": {"kind": "routed_expert"}, **fuse}
    with pytest.raises(ValueError, match=r"needs .* in one format"):
        resolve(_recipe(up, rest), SMALL)
    both = {"match": {"kind": "routed_expert"}, **fuse, **field}
    plan = resolve(_recipe(both), SMALL)
    assert plan[GATE0].fuse_group == plan[UP0].fuse_group


@pytest.mark.parametrize(("present", "missing"), [(GATE0, UP0), (UP0, GATE0)])
def test_a_fused_half_without_its_partner_names_the_missing_one(present, missing):
    rule = {"match": {"kind": "routed_expert"}, "format": "nvfp4", "fuse": ["gate", "up"]}
    with pytest.raises(ValueError) as err:
        resolve(_recipe(rule), {present: (32, 64), DOWN0: (64, 32)})
    assert f"but {missing!r} is not among the tensors" in str(err.value)


# --- problems -----------------------------------------------------------------------------------


def test_every_rule_that_matches_nothing_is_listed():
    rules = (
        {"match": {"kind": "mla"}, "format": "mxfp8"},
        {"match": {"name": "*.nothing.*"}, "format": "bf16"},
        {"match": {"kind": "attention"}, "format": "mxfp8"},
    )
    assert resolve(_recipe(*rules), SMALL).problems == (
        "rules[0] {kind: mla} -> mxfp8 matches no tensor of this model",
        "rules[1] {name: *.nothing.*} -> bf16 matches no tensor of this model (a typo in the glob?)",
    )


def test_a_bf16_rule_by_kind_that_selects_nothing_is_fine():
    rules = ({"match": {"kind": ["mla", "shared_expert"]}, "format": "bf16"},
             {"match": {"kind": "attention"}, "format": "mxfp8"})  # fmt: skip
    assert resolve(_recipe(*rules), SMALL).problems == ()


def test_a_rule_whose_tensors_an_earlier_rule_took_counts_them():
    rules = (
        {"match": {"kind": "routed_expert"}, "format": "bf16"},
        {"match": {"kind": ["routed_expert", "attention"], "layers": "0"}, "format": "mxfp8"},
        {"match": {"kind": "routed_expert"}, "format": "nvfp4"},
        {"match": {"kind": "routed_expert"}, "format": "bf16"},
    )
    plan = resolve(_recipe(*rules), SMALL)
    assert plan.problems == (
        "rules[2] {kind: routed_expert} -> nvfp4: every tensor it matches (3) is taken by an "
        "earlier rule",
    )
    assert plan[Q0].format is Format.MXFP8 and plan[GATE0].format is Format.BF16


def test_a_glob_counts_only_where_the_other_selectors_allow():
    """A rule's glob matches a tensor its kind excludes: the rule takes nothing, and says so;
    with a second glob that does match, the first is named on its own."""
    rule = {"match": {"kind": "routed_expert", "name": "*.q_proj.weight"}, "format": "mxfp8"}
    attention = {"match": {"kind": "attention"}, "format": "mxfp8"}
    assert resolve(_recipe(rule, attention), SMALL).problems == (
        "rules[0] {name: *.q_proj.weight, kind: routed_expert} -> mxfp8 matches no tensor of "
        "this model (a typo in the glob?)",
    )
    two = {**rule, "match": {**rule["match"], "name": ["*.q_proj.weight", "*.up_proj.weight"]}}
    plan = resolve(_recipe(two, attention), SMALL)
    assert plan.problems == (
        "rules[0] {name: [*.q_proj.weight, *.up_proj.weight], kind: routed_expert} -> mxfp8: its "
        "glob '*.q_proj.weight' matches no tensor of this model that the rule's other selectors "
        "allow (a typo in the glob?)",
    )
    assert plan[UP0].format is Format.MXFP8 and plan[GATE0].format is Format.BF16


def test_a_matching_glob_takes_its_tensors():
    rule = {"match": {"kind": "routed_expert", "name": ["*.up_proj.weight", "*.gate_proj.*"]},
            "format": "mxfp8"}  # fmt: skip
    plan = resolve(_recipe(rule), SMALL)
    assert plan.problems == ()
    assert [plan[n].format for n in (GATE0, UP0, DOWN0, Q0)] == [Format.MXFP8, Format.MXFP8,
                                                                  Format.BF16, Format.BF16]  # fmt: skip


def test_quantizing_nothing_is_a_problem_only_for_a_recipe_that_asks_for_low_precision():
    norms = {NORM: (64,), "model.layers.0.input_layernorm.weight": (64,)}
    nothing = "recipe 'probe' asks for low precision, but every tensor of this model resolves to "
    assert resolve(_recipe(default="mxfp8"), norms).problems == (nothing + "bf16: it quantizes "
                                                                 "nothing here",)  # fmt: skip
    assert resolve(_recipe(), norms).problems == ()
    bf16_rule = {"match": {"kind": "attention"}, "format": "bf16"}
    assert resolve(_recipe(bf16_rule), SMALL).problems == ()
    # one low-precision rule is enough to ask (its own problem comes first)
    mla = {"match": {"kind": "mla"}, "format": "nvfp4"}
    problems = resolve(_recipe(mla), SMALL).problems
    assert len(problems) == 2 and problems[1].startswith(nothing)
    # and a quantized tensor is enough to answer
    assert resolve(_recipe({"match": {"name": Q0}, "format": "mxfp8"}), SMALL).problems == ()


def test_the_plan_keeps_the_recipes_name_backward_and_kv_cache():
    plan = resolve(_recipe(backward="dequantized", kv_cache="fp8"), SMALL)
    assert (plan.recipe_name, plan.backward.value, plan.kv_cache.value) == (
        "probe", "dequantized", "fp8")  # fmt: skip
    assert resolve(_recipe(), SMALL).kv_cache.value == "compute"
