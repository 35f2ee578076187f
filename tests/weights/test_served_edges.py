"""Edges of writing a served checkpoint (mxrl.weights.served) that tests/weights/test_served.py
does not reach: the mutation run's survivors (docs/mutation/weights.served.md); its config.json
edges are in test_served_config.py.

Expected values are written out from the formats' definitions, not computed by the code under
test: the HF sharded-checkpoint layout (`model-0000i-of-0000n.safetensors` and an index whose
`total_size` is the bytes of every tensor), and the per-row NVFP4 global scale of a gate_up
tensor whose halves are scaled separately."""

import json
import re
import sys

import pytest
import torch
from safetensors import safe_open

from mxrl.formats import QTensor
from mxrl.recipe import resolve
from mxrl.weights import export
from mxrl.weights.digest import checksum
from mxrl.weights.record import WeightRecord
from mxrl.weights.served import served_tensors, write_served_checkpoint
from mxrl.weights.served_config import precision_contract
from tests.weights.served_cases import (
    FP8_L0,
    L0,
    model_and_plan,
    recipe,
)

# Not in the capability matrix, as tests/weights/test_served.py: no reduction here depends on the
# CPU capability, and the quantizer's bytes have their own capability tests.


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def file_tensors(path) -> dict[str, dict[str, torch.Tensor]]:
    """{file name: {key: tensor}} of every safetensors file in `path`."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out[f.name] = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
    return out


def leftovers(parent) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# --- writing ------------------------------------------------------------------------------------


def test_a_bf16_plan_writes_a_plain_checkpoint_of_the_source_config(tmp_path):
    model, plan = model_and_plan(recipe())
    source = {
        "model_type": "qwen3_moe",
        "dtype": "float32",
        "quantization_config": {"quant_method": "fp8"},  # a stale one: not this export's
        "mxrl": {"plan_hash": "stale"},
    }
    out = write_served_checkpoint(
        export(model, plan, bf16_dtype=torch.float16), plan, source, tmp_path / "served"
    )
    config = json.loads((out / "config.json").read_text())
    assert config == {
        "model_type": "qwen3_moe",
        "torch_dtype": "float16",
        "mxrl": precision_contract(plan),
    }
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    (files,) = file_tensors(out).values()
    params = {}  # the experts per expert, as HF's per-expert layout names them
    for name, p in model.named_parameters():
        prefix, _, last = name.rpartition(".")
        for e in range(p.shape[0] if last in ("gate_up_proj", "down_proj") else 0):
            if last == "down_proj":
                params[f"{prefix}.{e}.down_proj.weight"] = p[e]
            else:
                params[f"{prefix}.{e}.gate_proj.weight"] = p[e, :64]
                params[f"{prefix}.{e}.up_proj.weight"] = p[e, 64:]
        if last not in ("gate_up_proj", "down_proj"):
            params[name] = p
    assert set(files) == set(params)
    for name, p in params.items():
        assert files[name].dtype == torch.float16
        assert torch.equal(bits(files[name]), bits(p.detach().half())), name
    assert leftovers(tmp_path) == []


def _records(shapes: dict[str, tuple[int, ...]]):
    """A bf16 plan of these tensors and its records, in this order."""
    plan = resolve(recipe(), shapes)
    values = {
        n: torch.arange(torch.Size(s).numel()).reshape(s).bfloat16() for n, s in shapes.items()
    }
    return plan, [WeightRecord(n, v, checksum(n, v)) for n, v in values.items()]


SHAPES = {  # 64, 16, 64 and 32 bytes in bf16
    "model.embed_tokens.weight": (4, 8),
    "model.norm.weight": (8,),
    "lm_head.weight": (4, 8),
    "model.layers.0.input_layernorm.weight": (16,),
}


@pytest.mark.parametrize(
    ("limit", "shards"),
    [
        # greedy in record order: a shard takes the next tensor while it stays within the limit
        (80, [["model.embed_tokens.weight", "model.norm.weight"],
              ["lm_head.weight"], ["model.layers.0.input_layernorm.weight"]]),
        (96, [["model.embed_tokens.weight", "model.norm.weight"],
              ["lm_head.weight", "model.layers.0.input_layernorm.weight"]]),
        # a tensor larger than the limit is a shard of its own, and no shard is empty
        (10, [["model.embed_tokens.weight"], ["model.norm.weight"], ["lm_head.weight"],
              ["model.layers.0.input_layernorm.weight"]]),
    ],
)  # fmt: skip
def test_shards_and_index_as_hf_names_them(tmp_path, limit, shards):
    plan, records = _records(SHAPES)
    out = write_served_checkpoint(records, plan, {}, tmp_path / "served", shard_bytes=limit)
    n = len(shards)
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    files = file_tensors(out)
    assert sorted(files) == names
    for name, keys in zip(names, shards, strict=True):
        assert sorted(files[name]) == sorted(keys)
    for name in names:  # transformers refuses a safetensors file without format "pt"
        with safe_open(str(out / name), "pt") as st:
            assert st.metadata() == {"format": "pt"}
    text = (out / "model.safetensors.index.json").read_text()
    index = json.loads(text)
    # as transformers' save_pretrained writes it: sorted keys, two-space indent, a newline
    assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"
    assert index == {
        "metadata": {"total_size": 64 + 16 + 64 + 32},
        "weight_map": {k: name for name, keys in zip(names, shards, strict=True) for k in keys},
    }
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*names, "model.safetensors.index.json", "config.json"]
    )


def test_one_shard_when_everything_fits_exactly(tmp_path):
    plan, records = _records(SHAPES)
    total = sum(r.value.numel() * 2 for r in records)
    out = write_served_checkpoint(records, plan, {}, tmp_path / "served", shard_bytes=total)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_progress_bar_counts_the_plans_tensors_on_stderr_when_asked(tmp_path, capsys):
    plan, records = _records(SHAPES)
    write_served_checkpoint(records, plan, {}, tmp_path / "a", progress=True)
    err = capsys.readouterr().err
    # tqdm's bar: "exporting: 100%|...| 4/4 [00:00<00:00, 812.3tensor/s]"
    assert re.search(r"(^|\r)exporting: 100%\|.*\| 4/4 \[.*(tensor/s|s/tensor)\]", err), err
    write_served_checkpoint(records, plan, {}, tmp_path / "b", progress=False)
    write_served_checkpoint(records, plan, {}, tmp_path / "c")  # stderr is no terminal here
    assert capsys.readouterr().err == ""


def test_config_json_is_written_as_transformers_writes_it_into_new_parents(tmp_path):
    plan, records = _records(SHAPES)
    out = write_served_checkpoint(records, plan, {"b": 1, "a": [2]}, tmp_path / "x" / "y" / "z")
    assert out == tmp_path / "x" / "y" / "z"
    text = (out / "config.json").read_text()
    # PretrainedConfig.to_json_string: sorted keys, two-space indent, a trailing newline
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    assert list(json.loads(text)) == ["a", "b", "mxrl", "torch_dtype"]


def _bad(records, plan, tmp_path, match, **kwargs):
    with pytest.raises(ValueError, match=match):
        write_served_checkpoint(records, plan, {}, tmp_path / "served", **kwargs)
    assert not (tmp_path / "served").exists() and leftovers(tmp_path) == []


def test_records_that_do_not_match_the_plan_are_refused_leaving_nothing(tmp_path):
    plan, records = _records(SHAPES)
    _bad(records[:-1], plan, tmp_path, r"lack 1 tensor\(s\)")
    _bad([*records, records[0]], plan, tmp_path, "appears twice")
    stray = WeightRecord("model.stray.weight", records[0].value, records[0].hash)
    _bad([stray, *records], plan, tmp_path, "is not a tensor of the plan")
    forged = WeightRecord(records[1].name, records[1].value, records[0].hash)
    _bad([records[0], forged, *records[2:]], plan, tmp_path, "checksum mismatch")


def test_an_existing_directory_is_replaced_only_when_empty_or_asked(tmp_path):
    plan, records = _records(SHAPES)
    out = tmp_path / "served"
    out.mkdir()
    assert write_served_checkpoint(records, plan, {}, out) == out  # empty: taken
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        write_served_checkpoint(records, plan, {"a": 1}, out)
    assert "a" not in json.loads((out / "config.json").read_text())
    (out / "stale.txt").write_text("old")
    write_served_checkpoint(records, plan, {"a": 1}, out, overwrite=True)
    assert json.loads((out / "config.json").read_text())["a"] == 1
    assert not (out / "stale.txt").exists() and leftovers(tmp_path) == []
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        write_served_checkpoint(records, plan, {}, file)


# --- the tensors of one record ------------------------------------------------------------------


def test_fp8_block_gate_up_halves_take_their_block_rows():
    model, plan = model_and_plan(FP8_L0)
    name = f"{L0}.mlp.experts.gate_up_proj"
    (q,) = [r.value for r in export(model, plan).records() if r.name == name]
    assert tuple(q.scale.shape) == (2, 4, 2)  # [E, 2I/32, K/32]: I = 64 is two block rows
    got = dict(served_tensors(name, q))
    for e in (0, 1):
        gate, up = f"{L0}.mlp.experts.{e}.gate_proj", f"{L0}.mlp.experts.{e}.up_proj"
        assert torch.equal(bits(got[f"{gate}.weight"]), q.qdata[e, :64])
        assert torch.equal(bits(got[f"{up}.weight"]), q.qdata[e, 64:])
        assert torch.equal(got[f"{gate}.weight_scale_inv"], q.scale[e, 0:2])
        assert torch.equal(got[f"{up}.weight_scale_inv"], q.scale[e, 2:4])
        assert got[f"{gate}.weight"].dtype == torch.float8_e4m3fn
    assert len(got) == 8


def _nvfp4_gate_up(gs: torch.Tensor) -> QTensor:
    """An NVFP4 gate_up [2 experts, 4 rows, 16] with per-row global scales `gs` [2, 4, 1]."""
    return QTensor(
        torch.arange(2 * 4 * 8, dtype=torch.uint8).reshape(2, 4, 8),
        torch.full((2, 4, 1), 0.5).to(torch.float8_e4m3fn),
        "nvfp4",
        torch.Size((2, 4, 16)),
        global_scale=gs,
    )


def test_nvfp4_gate_and_up_each_write_their_own_global_scale():
    # halves scaled separately: each row holds its half's scale (gate rows 0-1, up rows 2-3)
    gs = torch.tensor([[1.0, 1.0, 2.0, 2.0], [3.0, 3.0, 4.0, 4.0]]).reshape(2, 4, 1)
    got = dict(served_tensors("model.layers.0.mlp.experts.gate_up_proj", _nvfp4_gate_up(gs)))
    want = {(0, "gate"): 1.0, (0, "up"): 2.0, (1, "gate"): 3.0, (1, "up"): 4.0}
    for (e, part), value in want.items():
        module = f"model.layers.0.mlp.experts.{e}.{part}_proj"
        assert got[f"{module}.weight_global_scale"].tolist() == [value]
        rows = slice(0, 2) if part == "gate" else slice(2, 4)
        assert torch.equal(got[f"{module}.weight_packed"], _nvfp4_gate_up(gs).qdata[e, rows])


def test_an_nvfp4_module_whose_rows_hold_two_global_scales_is_refused():
    gs = torch.tensor([[1.0, 5.0, 2.0, 2.0], [3.0, 3.0, 4.0, 4.0]]).reshape(2, 4, 1)
    # the refusal names the record and the Linear module whose rows disagree
    want = r"export model.layers.0.mlp.experts.gate_up_proj: .*experts.0.gate_proj would need one"
    with pytest.raises(ValueError, match=want):
        dict(served_tensors("model.layers.0.mlp.experts.gate_up_proj", _nvfp4_gate_up(gs)))


def test_a_two_row_nvfp4_gate_up_still_splits_its_global_scales():
    # intermediate size 1: gate is row 0 and up row 1, each with its own global scale
    gs = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).reshape(2, 2, 1)
    q = QTensor(
        torch.arange(2 * 2 * 8, dtype=torch.uint8).reshape(2, 2, 8),
        torch.full((2, 2, 1), 0.5).to(torch.float8_e4m3fn),
        "nvfp4",
        torch.Size((2, 2, 16)),
        global_scale=gs,
    )
    got = dict(served_tensors("model.layers.0.mlp.experts.gate_up_proj", q))
    prefix = "model.layers.0.mlp.experts"
    assert got[f"{prefix}.0.gate_proj.weight_global_scale"].tolist() == [1.0]
    assert got[f"{prefix}.0.up_proj.weight_global_scale"].tolist() == [2.0]
    assert got[f"{prefix}.1.up_proj.weight_global_scale"].tolist() == [4.0]


def test_torch_dtype_is_bfloat16_when_every_tensor_is_quantized(tmp_path):
    name = "model.layers.0.self_attn.q_proj.weight"
    plan = resolve(recipe({"match": {"kind": "attention"}, "format": "mxfp8"}), {name: (32, 32)})
    out = write_served_checkpoint(
        export({name: torch.randn(32, 32)}, plan), plan, {}, tmp_path / "served"
    )
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_a_bias_keeps_its_name():
    # qwen2_moe's attention biases: 1-D, not a Linear's weight, written under their own name
    shapes = {"model.layers.0.self_attn.q_proj.bias": (8,), "model.norm.weight": (8,)}
    _, records = _records(shapes)
    got = [k for r in records for k, _ in served_tensors(r.name, r.value)]
    assert got == list(shapes)


def test_built_in_a_hidden_sibling_while_the_records_stream(tmp_path):
    plan, records = _records(SHAPES)
    seen = []

    def stream():
        for r in records:
            seen.append(sorted(p.name for p in tmp_path.iterdir()))
            yield r

    write_served_checkpoint(stream(), plan, {}, tmp_path / "served")
    (building,) = seen[0]  # one entry beside the (absent) output: `.served.tmp-<random>`
    assert building.startswith(".served.tmp-") and all(s == [building] for s in seen)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]


def test_a_replaced_checkpoint_that_cannot_be_removed_is_the_error_raised(tmp_path, monkeypatch):
    import shutil

    plan, records = _records(SHAPES)
    out = write_served_checkpoint(records, plan, {}, tmp_path / "served")
    rmtree = shutil.rmtree

    def refuse_old(path, *args, **kwargs):
        if ".old-" in str(path):
            raise PermissionError(f"cannot remove {path}")
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", refuse_old)
    with pytest.raises(PermissionError, match="cannot remove"):
        write_served_checkpoint(records, plan, {"new": 1}, out, overwrite=True)
    monkeypatch.undo()
    assert json.loads((out / "config.json").read_text())["new"] == 1  # the new one is in place


def test_progress_bar_by_default_when_stderr_is_a_terminal(tmp_path, capsys, monkeypatch):
    plan, records = _records(SHAPES)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    write_served_checkpoint(records, plan, {}, tmp_path / "served")
    assert "exporting: 100%" in capsys.readouterr().err
