"""Plan: the hash contract, the JSON round trip, the audit table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxrl.arch import builtin_config, tensors_from_hf_config
from mxrl.formats.constants import Format
from mxrl.recipe import Plan, TensorSpec, list_presets, resolve

TINY = tuple(tensors_from_hf_config(builtin_config()))
REPO = Path(__file__).resolve().parents[2]
_HASH_SCRIPT = """
from mxrl.arch import builtin_config, tensors_from_hf_config
from mxrl.recipe import resolve
print(resolve("nvfp4-dequantized", tensors_from_hf_config(builtin_config())).hash())
"""


def _plan(preset="nvfp4-dequantized"):
    return resolve(preset, TINY)


def test_hash_is_stable_across_processes_and_hash_seeds():
    ours = _plan().hash()
    assert len(ours) == 64 and int(ours, 16) >= 0
    hashes = set()
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _HASH_SCRIPT],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        hashes.add(out.stdout.strip())
    assert hashes == {ours}


def test_hash_does_not_depend_on_tensor_order():
    assert resolve("mxfp8", TINY[::-1]).hash() == _plan("mxfp8").hash()


def test_json_round_trip():
    plan = _plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.hash() == plan.hash()
    assert again.backward == plan.backward and again.recipe_name == plan.recipe_name
    assert [s.rule for s in again.values()] == [s.rule for s in plan.values()]
    assert Plan.from_json(plan.to_json(indent=2)) == plan
    fp8 = resolve(
        "fp8-block",
        tensors_from_hf_config(
            {**builtin_config(), "hidden_size": 128, "head_dim": 32, "moe_intermediate_size": 128}
        ),
    )
    assert Plan.from_json(fp8.to_json()) == fp8


def test_from_json_rejects_tampering_and_other_schemas():
    text = _plan().to_json()
    with pytest.raises(ValueError, match="hash"):
        Plan.from_json(
            text.replace('"nvfp4"', '"mxfp8"', 1)
            .replace('"per_token"', "null", 1)
            .replace('"model.layers.0.mlp.experts.0.gate_up"', "null", 1)
        )
    with pytest.raises(ValueError, match="schema"):
        Plan.from_json(text.replace('"schema": 1', '"schema": 99'))


def test_hash_ignores_provenance_and_backward_but_not_formats():
    base = _plan("nvfp4-dequantized")
    same_formats = {
        "name": "other-words",
        "backward": "high_precision",
        "rules": [
            {"match": {"kind": "router"}, "format": "bf16"},
            {"match": {"layers": "3"}, "format": "bf16"},
            {"match": {"name": "*.experts.*"}, "format": "nvfp4", "fuse": ["up", "gate"]},
        ],
    }
    other = resolve(same_formats, TINY)
    assert [s.rule for s in other.values()] != [s.rule for s in base.values()]
    assert other.hash() == base.hash()
    assert other != base  # the plans differ (provenance, name, backward), the contract does not

    per_tensor = {
        **same_formats,
        "rules": [
            *same_formats["rules"][:2],
            {**same_formats["rules"][2], "activations": "per_tensor"},
        ],
    }
    assert resolve(per_tensor, TINY).hash() != base.hash()
    unfused = {
        **same_formats,
        "rules": [
            *same_formats["rules"][:2],
            {"match": {"name": "*.experts.*"}, "format": "nvfp4"},
        ],
    }
    assert resolve(unfused, TINY).hash() != base.hash()
    one_more_layer = {
        **same_formats,
        "rules": [
            *same_formats["rules"][:1],
            {"match": {"layers": "2-3"}, "format": "bf16"},
            same_formats["rules"][2],
        ],
    }
    assert resolve(one_more_layer, TINY).hash() != base.hash()
    assert _plan("mxfp8").hash() != _plan("bf16").hash()


def test_mapping_interface():
    plan = _plan()
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    assert name in plan and "nope" not in plan
    assert plan[name].fuse_group == "model.layers.0.mlp.experts.3.gate_up"
    assert len(plan) == len(TINY) == len(list(plan))
    assert list(plan) == [n for n, _ in TINY]
    assert plan.num_layers == 4
    with pytest.raises(KeyError):
        plan["nope"]


def test_table_groups_experts_and_summarises():
    table = _plan().table()
    lines = table.splitlines()
    assert lines[0].split()[:6] == ["name", "shape", "kind", "layer", "format", "rule"]
    gate = [
        ln for ln in lines if ln.startswith("model.layers.0.mlp.experts.*.gate_proj.weight [x8]")
    ]
    assert len(gate) == 1 and "nvfp4 act=per_token fuse=gate+up" in gate[0]
    assert "rules[4] {kind: routed_expert}" in gate[0]
    assert not any(".experts.0." in ln for ln in lines)
    assert any(
        ln.startswith("model.layers.3.mlp.experts.*.down_proj.weight [x8]") and "bf16" in ln
        for ln in lines
    )
    assert any(ln.startswith("model.norm.weight") and "not a matmul weight" in ln for ln in lines)
    # one line per non-expert tensor, one per (layer, role) expert group
    num_rows = len(TINY) - 4 * 3 * 8 + 4 * 3
    assert len([ln for ln in lines if ln.startswith(("model.", "lm_head"))]) == num_rows
    summary = table[table.index("summary:") :]
    assert "bf16" in summary and "nvfp4" in summary and "all-bf16" in summary


def test_table_spells_out_split_expert_groups():
    recipe = {
        "name": "t",
        "rules": [{"match": {"name": ["*.experts.[0-2].*", "*.experts.5.*"]}, "format": "mxfp8"}],
    }
    lines = resolve(recipe, TINY).table().splitlines()
    assert any(
        ln.startswith("model.layers.1.mlp.experts.{0-2,5}.up_proj.weight [x4]") and "mxfp8" in ln
        for ln in lines
    )
    assert any(
        ln.startswith("model.layers.1.mlp.experts.{3-4,6-7}.up_proj.weight [x4]") for ln in lines
    )


def test_table_bytes():
    table = _plan("bf16").table()
    assert "(100.0%)" in table
    # tiny model: routed experts of layers 0-2 at 4.5 bits per weight instead of 16
    assert "(65.4%)" in _plan().table()


def test_tensor_spec_validation():
    base = dict(name="x.weight", shape=(4, 32), kind="attention", layer=0, expert=None, role="q")
    spec = TensorSpec(**base, format="mxfp8")
    assert spec.format is Format.MXFP8 and spec.shape == (4, 32)
    with pytest.raises(ValueError, match="activations"):
        TensorSpec(**base, format="nvfp4")
    with pytest.raises(ValueError, match="nvfp4 fields"):
        TensorSpec(**base, format="mxfp8", activations="per_token")
    with pytest.raises(ValueError, match="block"):
        TensorSpec(**base, format="fp8_block")
    with pytest.raises(ValueError, match="duplicate"):
        Plan("t", "high_precision", 1, (spec, spec))


# --- a plan that does not do what its recipe says ----------------------------------------------


def _moe_tensors():
    from tests.arch.hf_configs import QWEN3_30B_A3B

    return tensors_from_hf_config(QWEN3_30B_A3B)


def _recipe(*rules, default="bf16"):
    return {"name": "probe", "default": default, "rules": list(rules)}


def test_a_name_glob_that_matches_nothing_is_a_problem_even_for_bf16():
    typo = {"match": {"name": "*.mlp.expertz.*"}, "format": "bf16"}
    good = {"match": {"kind": "routed_expert"}, "format": "nvfp4"}
    plan = resolve(_recipe(typo, good), _moe_tensors())
    assert plan.problems == (
        "rules[0] {name: *.mlp.expertz.*} -> bf16 matches no tensor of this model "
        "(a typo in the glob?)",
    )
    with pytest.raises(ValueError, match=r"expertz.*--allow-unmatched") as err:
        plan.check()
    assert "\n" not in str(err.value)  # one `mxrl: error:` line


def test_every_glob_of_a_name_list_must_match_something():
    """One good glob must not hide a typo in the next: each glob of a list is checked alone,
    and a glob that matches only tensors the rule's kind excludes counts as matching nothing."""
    listed = {
        "match": {"name": ["*.self_attn.q_proj.weight", "*.self_attn.k_porj.weight"]},
        "format": "bf16",
    }
    elsewhere = {
        "match": {"kind": "routed_expert", "name": ["*.experts.*", "*.self_attn.v_proj.*"]},
        "format": "nvfp4",
    }
    plan = resolve(_recipe(listed, elsewhere), _moe_tensors())
    assert plan.problems == (
        "rules[0] {name: [*.self_attn.q_proj.weight, *.self_attn.k_porj.weight]} -> bf16: its "
        "glob '*.self_attn.k_porj.weight' matches no tensor of this model that the rule's other "
        "selectors allow (a typo in the glob?)",
        "rules[1] {name: [*.experts.*, *.self_attn.v_proj.*], kind: routed_expert} -> nvfp4: its "
        "glob '*.self_attn.v_proj.*' matches no tensor of this model that the rule's other "
        "selectors allow (a typo in the glob?)",
    )
    with pytest.raises(ValueError, match=r"k_porj"):
        plan.check()
    fixed = {**listed, "match": {"name": ["*.self_attn.q_proj.weight", "*.k_proj.weight"]}}
    assert resolve(_recipe(fixed), _moe_tensors()).problems == ()


def test_low_precision_rules_that_take_nothing_are_problems(caplog):
    shadow = {"match": {"kind": "routed_expert"}, "format": "bf16"}
    nv = {"match": {"kind": "routed_expert"}, "format": "nvfp4"}
    mla = {"match": {"kind": "mla"}, "format": "mxfp8"}
    plan = resolve(_recipe(shadow, nv, mla), _moe_tensors())
    assert len(plan.problems) == 3
    assert "rules[1] {kind: routed_expert} -> nvfp4: every tensor it matches" in plan.problems[0]
    assert "rules[2] {kind: mla} -> mxfp8 matches no tensor" in plan.problems[1]
    assert "quantizes nothing here" in plan.problems[2]
    with caplog.at_level("WARNING"):
        plan.check(strict=False)
    assert "does not do what it says" in caplog.text


def test_bf16_exceptions_for_kinds_a_model_lacks_are_fine():
    """Presets keep routers, MLA and shared experts bf16 for every family they serve."""
    for preset in list_presets():
        plan = resolve(preset, _moe_tensors())  # no MLA, no shared expert
        assert plan.problems == (), preset
        plan.check()
    assert resolve("bf16", _moe_tensors()).problems == ()


def test_an_nvfp4_preset_on_a_dense_model_quantizes_nothing():
    from tests.arch.hf_configs import QWEN3_0_6B

    plan = resolve("nvfp4-dequantized", tensors_from_hf_config(QWEN3_0_6B))
    assert not plan.quantized
    assert any("quantizes nothing" in p for p in plan.problems)
    assert Plan.from_json(plan.to_json()).problems == plan.problems  # kept in the record


# --- NVFP4 4over6 (scale_mode) -----------------------------------------------------------------


def test_4over6_round_trips_shows_and_reaches_the_quantizer():
    """The preset's experts carry scale_mode 4over6 through JSON, the audit and the quantizer
    options of the weight and of its activation (the same rule for both); other tensors and
    nvfp4-hp's keep none."""
    from mxrl.recipe.quantize import activation_quantizer_kwargs, weight_quantizer_kwargs

    plan = _plan("nvfp4-4over6-hp")
    experts = [s for s in plan.values() if s.format is Format.NVFP4]
    assert experts and all(s.scale_mode == "4over6" for s in experts)
    assert all(s.scale_mode is None for s in plan.values() if s.format is not Format.NVFP4)
    assert all(s.scale_mode is None for s in _plan("nvfp4-hp").values())
    assert Plan.from_json(plan.to_json()) == plan
    assert "nvfp4 4over6 act=per_token fuse=gate+up" in plan.table()
    spec = experts[0]
    import torch

    w = torch.randn(spec.shape)
    assert weight_quantizer_kwargs(w, spec)["scale_mode"] == "4over6"
    assert activation_quantizer_kwargs(spec) == {"per_token": True, "scale_mode": "4over6"}
    plain = next(s for s in _plan("nvfp4-hp").values() if s.format is Format.NVFP4)
    assert "scale_mode" not in weight_quantizer_kwargs(w, plain)
    assert activation_quantizer_kwargs(plain) == {"per_token": True}


def test_4over6_is_nvfp4_only_in_a_spec_and_fuse_partners_must_agree():
    base = dict(name="x.weight", shape=(4, 32), kind="attention", layer=0, expert=None, role="q")
    with pytest.raises(ValueError, match="scale_mode"):
        TensorSpec(**base, format="mxfp8", scale_mode="4over6")
    with pytest.raises(ValueError, match="scale_mode"):
        TensorSpec(**base, format="nvfp4", activations="per_token", scale_mode="te")
    tensors = tensors_from_hf_config(builtin_config(), "per_expert")
    nvfp4 = {"format": "nvfp4", "fuse": ["gate", "up"]}
    split = _recipe(
        {"match": {"name": "*.gate_proj.weight"}, **nvfp4, "scale_mode": "4over6"},
        {"match": {"kind": "routed_expert"}, **nvfp4},
    )
    with pytest.raises(ValueError, match=r"fuse: .*4over6 per_token fused"):
        resolve(split, tensors)
