"""Quantized checkpoints: conversion through the export path, loading into an Engine, integrity."""

import json
import shutil
import struct

import pytest
import torch
from safetensors import safe_open

from mxrl.cli import main
from mxrl.engine import Engine
from mxrl.models import save_pretrained
from mxrl.recipe import Plan, resolve
from mxrl.weights import (
    MANIFEST_NAME,
    PLAN_NAME,
    convert_checkpoint,
    export_weights,
    read_quantized_checkpoint,
    write_quantized_checkpoint,
)
from tests.sync.helpers import PROMPT, engine_logits, hashes, tiny

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

PRESET = "nvfp4-dequantized"
SHARD_BYTES = 150_000  # the tiny model's 0.38 MiB export -> 3 shards


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny-moe"
    save_pretrained(tiny(seed=0), path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
    return path


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    return convert_checkpoint(
        hf_dir, PRESET, tmp_path_factory.mktemp("q") / "tiny-nvfp4", shard_bytes=SHARD_BYTES
    )


def live_plan():
    model = tiny(seed=0)
    return model, resolve(PRESET, {n: p.shape for n, p in model.named_parameters()})


def test_layout_manifest_and_shards(converted, hf_dir):
    files = sorted(p.name for p in converted.iterdir())
    assert files == [
        "config.json",
        "manifest.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "plan.json",
        "tokenizer_config.json",
    ]
    assert json.loads((converted / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )
    manifest = json.loads((converted / MANIFEST_NAME).read_text())
    model, plan = live_plan()
    assert manifest["plan_hash"] == plan.hash()
    assert list(manifest["tensors"]) == list(plan)
    assert manifest["tensors"] == {
        name: {
            "shard": manifest["tensors"][name]["shard"],
            "format": str(plan[name].format),
            "shape": list(plan[name].shape),
            "bytes": r.nbytes,
            "hash": r.hash,
            "keys": manifest["tensors"][name]["keys"],
        }
        for r in export_weights(model.named_parameters(), plan)
        for name in [r.name]
    }
    per_shard: dict[str, int] = {}
    for t in manifest["tensors"].values():
        per_shard[t["shard"]] = per_shard.get(t["shard"], 0) + t["bytes"]
    assert all(b <= SHARD_BYTES for b in per_shard.values())
    assert manifest["num_bytes"] == sum(per_shard.values())
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    entry = manifest["tensors"][gate_up]
    assert entry["keys"] == [f"{gate_up}.qdata", f"{gate_up}.scale", f"{gate_up}.global_scale"]
    with safe_open(str(converted / entry["shard"]), framework="pt") as f:
        assert set(entry["keys"]) <= set(f.keys())
        assert f.get_tensor(f"{gate_up}.scale").dtype == torch.float8_e4m3fn
    event = manifest["quantization_event"]
    assert event["plan_hash"] == plan.hash() and event["num_bytes"] == manifest["num_bytes"]
    assert set(event["sqnr_db"]) == {"layer.0", "layer.1", "layer.2"}


def test_plan_json_round_trips(converted):
    _, plan = live_plan()
    text = (converted / PLAN_NAME).read_text()
    back = Plan.from_json(text)
    assert back == plan and back.hash() == plan.hash()
    assert back.to_json(indent=2) + "\n" == text


def test_engine_from_checkpoint_holds_the_bytes_of_a_live_export(converted):
    engine = Engine.from_checkpoint(converted)
    model, plan = live_plan()
    assert engine.plan.hash() == plan.hash()
    assert hashes(engine.records()) == hashes(export_weights(model.named_parameters(), plan))
    live = Engine(model, PRESET)
    assert torch.equal(engine_logits(engine), engine_logits(live, PROMPT))


def corrupt_copy(converted, tmp_path, shard, mutate):
    copy = tmp_path / "copy"
    shutil.copytree(converted, copy)
    mutate(copy / shard)
    return copy


def tensor_start(path, key) -> int:
    """Byte offset in the file of the first data byte of `key` (safetensors layout)."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    return 8 + header_len + header[key]["data_offsets"][0]


def test_a_flipped_data_byte_is_caught_naming_file_and_tensor(converted, tmp_path):
    manifest = json.loads((converted / MANIFEST_NAME).read_text())
    name = "model.layers.2.mlp.experts.down_proj"
    shard = manifest["tensors"][name]["shard"]

    def flip(path):
        raw = bytearray(path.read_bytes())
        raw[tensor_start(path, f"{name}.qdata") + 100] ^= 0x04
        path.write_bytes(bytes(raw))

    copy = corrupt_copy(converted, tmp_path, shard, flip)
    engine = Engine(tiny(seed=1), PRESET)
    version, held = engine.weights_version, hashes(engine.records())
    plan, _, records = read_quantized_checkpoint(copy)  # sizes are fine: found when read
    with pytest.raises(ValueError, match=shard) as err:
        engine.load_weights(records, plan.hash())
    assert name in str(err.value) and "sha256" in str(err.value)
    assert engine.weights_version == version and hashes(engine.records()) == held
    with pytest.raises(ValueError, match=name):
        Engine.from_checkpoint(copy)


def test_a_truncated_shard_is_caught_naming_the_file(converted, tmp_path):
    shard = "model-00002-of-00003.safetensors"

    def truncate(path):
        path.write_bytes(path.read_bytes()[:-1000])

    copy = corrupt_copy(converted, tmp_path, shard, truncate)
    with pytest.raises(ValueError, match=rf"{shard}.*truncated"):
        read_quantized_checkpoint(copy)


def test_an_edited_manifest_hash_is_caught_by_the_engine(converted, tmp_path):
    def edit(path):
        m = json.loads(path.read_text())
        m["tensors"]["lm_head.weight"]["hash"] = "0" * 64
        path.write_text(json.dumps(m))

    copy = corrupt_copy(converted, tmp_path, MANIFEST_NAME, edit)
    with pytest.raises(ValueError, match=r"lm_head\.weight: checksum mismatch"):
        Engine.from_checkpoint(copy)


def test_a_failed_write_leaves_nothing(tmp_path):
    model, plan = live_plan()

    def records_then_failure():
        for i, r in enumerate(export_weights(model.named_parameters(), plan)):
            if i == 40:
                raise RuntimeError("disk full")
            yield r

    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk full"):
        write_quantized_checkpoint(records_then_failure(), plan, {}, out, shard_bytes=50_000)
    with pytest.raises(ValueError, match="lack 1 tensor"):
        records = list(export_weights(model.named_parameters(), plan))[:-1]
        write_quantized_checkpoint(records, plan, {}, out)
    assert list(tmp_path.iterdir()) == []


def test_cli_convert_end_to_end(hf_dir, tmp_path, capsys):
    out = tmp_path / "mxfp8"
    assert main(["convert", "--recipe", "mxfp8", "--model", str(hf_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mxfp8" in printed and "plan hash" in printed and "SQNR" in printed
    assert (out / "model-00001-of-00001.safetensors").is_file()
    engine = Engine.from_checkpoint(out)
    model = tiny(seed=0)
    assert hashes(engine.records()) == hashes(export_weights(model.named_parameters(), engine.plan))
    argv = ["convert", "--recipe", "mxfp8", "--model", str(hf_dir), "--out", str(out)]
    assert main(argv) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--shard-size", "100KB"]) == 0
    assert len(list(out.glob("*.safetensors"))) == 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--recipe", "no-such-recipe"], "no such preset"),
        (["--model", "/nonexistent/model"], "not a directory"),
        (["--shard-size", "lots"], "shard size 'lots'"),
    ],
)
def test_cli_convert_user_errors_exit_2(hf_dir, tmp_path, capsys, args, message):
    base = {"--recipe": "mxfp8", "--model": str(hf_dir), "--out": str(tmp_path / "out")}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    argv = ["convert", *[x for kv in base.items() for x in kv]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mxrl: error:") and message in err
    assert not (tmp_path / "out").exists()


def test_cli_convert_refuses_a_recipe_that_quantizes_nothing(tmp_path, capsys):
    """nvfp4-dequantized on a dense Qwen3 (no routed experts) would write an all-bf16 checkpoint
    labelled nvfp4: refused before anything is written, after printing the plan's summary;
    --allow-unmatched converts it anyway (and still warns)."""
    from mxrl.models import build_model
    from tests.models.configs import CONFIGS

    dense = tmp_path / "dense"
    save_pretrained(build_model(CONFIGS["qwen3-tied"], seed=0), dense)
    out = tmp_path / "out"
    argv = ["convert", "--recipe", PRESET, "--model", str(dense), "--out", str(out)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "summary: recipe nvfp4-dequantized" in captured.out  # printed first
    assert "bf16" in captured.out and "nvfp4 " not in captured.out
    assert "quantizes nothing here" in captured.err and "--allow-unmatched" in captured.err
    assert "rules[4] {kind: routed_expert} -> nvfp4 matches no tensor" in captured.err
    assert not out.exists()
    assert main([*argv, "--allow-unmatched"]) == 0
    assert "mxrl: warning:" in capsys.readouterr().err
    assert (out / MANIFEST_NAME).is_file()
