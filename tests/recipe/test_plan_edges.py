"""Plan and TensorSpec edges the mutation run of `recipe.plan` found unheld (docs/mutation/
recipe.plan.md): the hash's canonical JSON written out by hand from docs/recipes.md ("The plan
and its hash"), kv_cache in it, each of TensorSpec's refusals on its own, the duplicate-name
refusal's list, `quantized`, `check`, and JSON files without the optional keys."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from mxrl.formats.constants import Format
from mxrl.recipe import Plan, TensorSpec
from mxrl.recipe.schema import Backward, KVCacheFormat

Q = dict(name="a.weight", shape=(4, 32), kind="attention", layer=0, expert=None, role="q")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _one(spec: TensorSpec, **kw) -> Plan:
    return Plan("probe", "high_precision", 1, (spec,), **kw)


# --- the hash, from its definition --------------------------------------------------------------


def test_the_hash_is_the_sha256_of_the_documented_text():
    """sorted keys, no whitespace, tensors sorted by name; nothing of the recipe's name, the
    backward mode, num_layers or the provenance."""
    b = TensorSpec(**{**Q, "name": "b.weight"}, format="mxfp8", rule="rules[0] {}")
    a = TensorSpec(**Q, format="nvfp4", activations="per_tensor", fuse_group="g")
    plan = Plan("whatever", "dequantized", 7, (b, a))
    text = (
        '{"schema":1,"tensors":['
        '{"activations":"per_tensor","block":null,"format":"nvfp4","fuse_group":"g",'
        '"name":"a.weight","shape":[4,32]},'
        '{"activations":null,"block":null,"format":"mxfp8","fuse_group":null,'
        '"name":"b.weight","shape":[4,32]}]}'
    )
    assert plan.hash() == _sha(text)


def test_fp8_block_and_4over6_entries():
    blk = TensorSpec(**Q, format="fp8_block", block=(128, 32))
    assert _one(blk).hash() == _sha(
        '{"schema":1,"tensors":[{"activations":null,"block":[128,32],"format":"fp8_block",'
        '"fuse_group":null,"name":"a.weight","shape":[4,32]}]}'
    )
    s46 = TensorSpec(**Q, format="nvfp4", activations="per_token", scale_mode="4over6")
    assert _one(s46).hash() == _sha(
        '{"schema":1,"tensors":[{"activations":"per_token","block":null,"format":"nvfp4",'
        '"fuse_group":null,"name":"a.weight","scale_mode":"4over6","shape":[4,32]}]}'
    )


def test_an_fp8_kv_cache_is_in_the_hash_and_compute_is_not():
    spec = TensorSpec(**Q, format="mxfp8")
    tensors = (
        '"tensors":[{"activations":null,"block":null,"format":"mxfp8","fuse_group":null,'
        '"name":"a.weight","shape":[4,32]}]'
    )
    assert _one(spec, kv_cache="fp8").hash() == _sha(
        '{"kv_cache":"fp8","schema":1,' + tensors + "}"
    )
    assert _one(spec, kv_cache="compute").hash() == _sha('{"schema":1,' + tensors + "}")
    assert _one(spec).hash() == _sha('{"schema":1,' + tensors + "}")


def test_a_name_outside_ascii_is_escaped_in_the_hashed_text():
    spec = TensorSpec(**{**Q, "name": "caf\u00e9.weight"}, format="bf16")
    assert _one(spec).hash() == _sha(
        '{"schema":1,"tensors":[{"activations":null,"block":null,"format":"bf16",'
        '"fuse_group":null,"name":"caf\\u00e9.weight","shape":[4,32]}]}'
    )


# --- TensorSpec ---------------------------------------------------------------------------------


def test_fields_are_coerced_to_their_types():
    spec = TensorSpec(**{**Q, "shape": [4, 32]}, format="fp8_block", block=[64, 32])
    assert spec.shape == (4, 32) and type(spec.shape) is tuple
    assert spec.block == (64, 32) and type(spec.block) is tuple
    assert spec.format is Format.FP8_BLOCK and spec.kind.value == "attention"
    assert type(spec.kind) is not str
    # a float read from a hand-edited file: int() of each dim, not the value kept
    spec = TensorSpec(**{**Q, "shape": (4.0, 32.0)}, format="fp8_block", block=(64.0, 32.0))
    assert [type(d) for d in (*spec.shape, *spec.block)] == [int] * 4


@pytest.mark.parametrize("activations", ["per_token", "per_tensor"])
def test_nvfp4_takes_either_activation_scale_and_a_fuse_group(activations):
    spec = TensorSpec(**Q, format="nvfp4", activations=activations, fuse_group="g")
    assert (spec.activations, spec.fuse_group) == (activations, "g")


@pytest.mark.parametrize("activations", [None, "per_row", "PER_TOKEN"])
def test_nvfp4_refuses_a_missing_or_unknown_activation_scale(activations):
    with pytest.raises(ValueError, match="activations must be one of"):
        TensorSpec(**Q, format="nvfp4", activations=activations)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@pytest.mark.parametrize("field", [{"activations": "per_token"}, {"fuse_group": "g"}])
def test_activations_and_fuse_group_each_alone_are_nvfp4_only(fmt, field):
    with pytest.raises(ValueError, match="nvfp4 fields"):
        TensorSpec(**Q, format=fmt, **field)


def test_block_is_set_exactly_for_fp8_block():
    with pytest.raises(ValueError, match="block is set exactly"):
        TensorSpec(**Q, format="mxfp8", block=(128, 128))
    with pytest.raises(ValueError, match="block is set exactly"):
        TensorSpec(**Q, format="fp8_block")
    assert TensorSpec(**Q, format="fp8_block", block=(128, 128)).block == (128, 128)


def test_scale_mode_is_none_or_4over6_and_4over6_only_for_nvfp4():
    nv = dict(format="nvfp4", activations="per_token")
    assert TensorSpec(**Q, **nv, scale_mode="4over6").scale_mode == "4over6"
    assert TensorSpec(**Q, **nv).scale_mode is None
    for fmt in ("bf16", "mxfp8"):
        assert TensorSpec(**Q, format=fmt).scale_mode is None
        with pytest.raises(ValueError, match="scale_mode"):
            TensorSpec(**Q, format=fmt, scale_mode="4over6")
    for bad in ("te", "4OVER6", ""):
        with pytest.raises(ValueError, match="scale_mode"):
            TensorSpec(**Q, **nv, scale_mode=bad)


def test_to_dict_is_the_contract_plus_the_provenance():
    spec = TensorSpec(
        name="model.layers.2.mlp.experts.5.up_proj.weight", shape=(32, 64),
        kind="routed_expert", layer=2, expert=5, role="up", format="nvfp4",
        activations="per_token", fuse_group="model.layers.2.mlp.experts.5.gate_up",
        rule="rules[1] {kind: routed_expert}", scale_mode="4over6",
    )  # fmt: skip
    assert spec.to_dict() == {
        "name": "model.layers.2.mlp.experts.5.up_proj.weight",
        "shape": [32, 64],
        "format": "nvfp4",
        "activations": "per_token",
        "fuse_group": "model.layers.2.mlp.experts.5.gate_up",
        "block": None,
        "scale_mode": "4over6",
        "kind": "routed_expert",
        "layer": 2,
        "expert": 5,
        "role": "up",
        "rule": "rules[1] {kind: routed_expert}",
    }


# --- Plan ---------------------------------------------------------------------------------------


def test_duplicate_names_are_listed_sorted_five_at_most():
    names = ["f", "e", "d", "c", "b", "a"]
    specs = [TensorSpec(**{**Q, "name": n}, format="bf16") for n in [*names, *names, "single"]]
    with pytest.raises(ValueError) as err:
        Plan("t", "high_precision", 1, tuple(specs))
    assert str(err.value).endswith("['a', 'b', 'c', 'd', 'e']")
    specs = [TensorSpec(**{**Q, "name": n}, format="bf16") for n in ("x", "y", "x")]
    with pytest.raises(ValueError) as err:
        Plan("t", "high_precision", 1, tuple(specs))
    assert str(err.value).endswith("['x']")


def test_the_fields_are_coerced_and_the_mapping_follows_the_specs():
    specs = [TensorSpec(**{**Q, "name": n}, format="bf16") for n in ("z", "a")]
    plan = Plan("t", "quantized", 3, specs, problems=["p"], kv_cache="fp8")
    assert plan.backward is Backward.QUANTIZED and plan.kv_cache is KVCacheFormat.FP8
    assert type(plan.specs) is tuple and plan.problems == ("p",)
    assert list(plan) == ["z", "a"] and len(plan) == 2 and plan["a"] is specs[1]
    assert "a" in plan and "q" not in plan and 0 not in plan


def test_quantized_means_some_tensor_is_not_bf16():
    bf16 = TensorSpec(**Q, format="bf16")
    mx = TensorSpec(**{**Q, "name": "b.weight"}, format="mxfp8")
    assert not _one(bf16).quantized
    assert Plan("t", "high_precision", 1, (bf16, mx)).quantized
    assert Plan("t", "high_precision", 1, (mx, bf16)).quantized
    assert not Plan("t", "high_precision", 0, ()).quantized


def test_check_passes_a_plan_without_problems_and_lists_every_problem():
    _one(TensorSpec(**Q, format="bf16")).check()  # strict by default: no problems, no refusal
    plan = _one(TensorSpec(**Q, format="bf16"), problems=("first thing", "second thing"))
    with pytest.raises(ValueError) as err:
        plan.check()
    assert "'probe' does not do what it says on this model: first thing; second thing." in str(
        err.value
    )
    with pytest.raises(ValueError):
        plan.check(strict=True)


def test_check_not_strict_warns_and_returns(caplog):
    plan = _one(TensorSpec(**Q, format="bf16"), problems=("one", "two"))
    with caplog.at_level(logging.WARNING, logger="mxrl.recipe.plan"):
        assert plan.check(strict=False) is None
    assert "'probe' does not do what it says on this model: one; two (allowed: not strict)" in (
        caplog.text
    )


# --- JSON ---------------------------------------------------------------------------------------


def test_to_json_writes_every_field_in_order():
    spec = TensorSpec(**Q, format="fp8_block", block=(128, 32), rule="rules[0] {}")
    plan = Plan("probe", "dequantized", 3, (spec,), problems=("p",), kv_cache="fp8")
    data = json.loads(plan.to_json())
    assert list(data) == ["schema", "recipe_name", "backward", "num_layers", "kv_cache", "hash",
                          "problems", "tensors"]  # fmt: skip
    assert data["schema"] == 1 and data["recipe_name"] == "probe"
    assert data["backward"] == "dequantized" and data["num_layers"] == 3
    assert data["kv_cache"] == "fp8" and data["problems"] == ["p"]
    assert data["hash"] == plan.hash()
    assert data["tensors"] == [spec.to_dict()]
    assert "\n" not in plan.to_json()
    assert plan.to_json(indent=2).startswith('{\n  "schema": 1,\n  "recipe_name": "probe"')


def test_from_json_of_a_file_without_the_optional_keys():
    """An older file: no kv_cache (compute), no problems (none), no hash (not checked)."""
    spec = TensorSpec(**Q, format="mxfp8")
    text = json.dumps({
        "schema": 1, "recipe_name": "old", "backward": "high_precision", "num_layers": "2",
        "tensors": [{**spec.to_dict()}],
    })  # fmt: skip
    plan = Plan.from_json(text)
    assert plan.kv_cache is KVCacheFormat.COMPUTE and plan.problems == ()
    assert plan.num_layers == 2 and type(plan.num_layers) is int
    assert plan.recipe_name == "old" and plan.backward is Backward.HIGH_PRECISION
    assert plan["a.weight"] == spec


def test_from_json_keeps_kv_cache_and_problems_and_checks_the_hash():
    plan = _one(TensorSpec(**Q, format="mxfp8"), problems=("p",), kv_cache="fp8")
    again = Plan.from_json(plan.to_json())
    assert again.kv_cache is KVCacheFormat.FP8 and again.problems == ("p",)
    assert again.hash() == plan.hash()
    # the kv_cache edited, the hash kept: the tensors no longer hash to it
    with pytest.raises(ValueError, match="hash"):
        Plan.from_json(plan.to_json().replace('"kv_cache": "fp8"', '"kv_cache": "compute"'))


@pytest.mark.parametrize("schema", [None, 0, 2, "1"])
def test_from_json_refuses_any_other_schema(schema):
    data = json.loads(_one(TensorSpec(**Q, format="bf16")).to_json())
    if schema is None:
        del data["schema"]
    else:
        data["schema"] = schema
    with pytest.raises(ValueError, match="plan schema"):
        Plan.from_json(json.dumps(data))


def test_summary_is_the_audit_of_this_plan():
    """128 mxfp8 values: 128 bytes and 4 E8M0 scales (one per 32); 128 bf16 values: 256 bytes."""
    mx = TensorSpec(**Q, format="mxfp8")
    bf16 = TensorSpec(**{**Q, "name": "b.weight"}, format="bf16")
    lines = Plan("probe", "high_precision", 1, (mx, bf16), kv_cache="fp8").summary().splitlines()
    assert lines[0] == "summary: recipe probe, backward high_precision, 1 layers, KV cache fp8"
    assert " ".join(lines[-1].split()) == "total 2 tensors; 388 B vs 512 B all-bf16 (75.8%)"
