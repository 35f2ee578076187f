"""A quantized checkpoint checked against its plan when it is read: config.json must describe the
model plan.json was resolved for (an edited field is named), and every tensor's fields must be
what the plan stores, even when whoever edited a shard also rewrote its sha256 and checksum in
the manifest. (No `mxrl` command loads a quantized checkpoint: these are the Python API's
refusals, `read_quantized_checkpoint` and `Engine.from_checkpoint`.)"""

import dataclasses
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxrl.engine import Engine
from mxrl.formats import QTensor
from mxrl.models import save_pretrained
from mxrl.weights import MANIFEST_NAME, checksum, convert_checkpoint, read_quantized_checkpoint
from mxrl.weights.quantized_checkpoint import sha256_file
from tests.sync.helpers import tiny

GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    save_pretrained(tiny(seed=0), root / "hf")
    return convert_checkpoint(root / "hf", "nvfp4-dequantized", root / "q", shard_bytes=150_000)


def edited_config(converted, tmp_path, **fields):
    out = shutil.copytree(converted, tmp_path / "edited")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **fields}))
    return out


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_hidden_layers": 5}, "num_hidden_layers is 5, but the plan was resolved for a model "
         "of 4 layers"),  # was a KeyError from the engine
        ({"num_hidden_layers": 3}, "num_hidden_layers is 3"),  # was an AttributeError
        ({"hidden_size": 96}, r"field hidden_size gives model\.embed_tokens\.weight the shape "
         r"\(64, 96\), but the plan holds it as \(64, 64\)"),
        ({"moe_intermediate_size": 16}, r"field moe_intermediate_size gives "
         r"model\.layers\.0\.mlp\.experts\.gate_up_proj the shape \(8, 32, 64\)"),
        ({"num_experts": 4}, r"field num_experts gives model\.layers\.0\.mlp\.gate\.weight"),
        ({"vocab_size": 65}, "field vocab_size gives"),
        ({"tie_word_embeddings": True}, r"field tie_word_embeddings describes a model without "
         r"the plan's \['lm_head\.weight'\]"),
        ({"model_type": "llama"}, "model_type: 'llama' is not supported"),
    ],
)  # fmt: skip
def test_an_edited_config_is_refused_naming_the_file_and_field(
    converted, tmp_path, fields, message
):
    path = edited_config(converted, tmp_path, **fields)
    want = re.escape(str(path / "config.json")) + ": " + message
    with pytest.raises(ValueError, match=want):
        read_quantized_checkpoint(path)
    with pytest.raises(ValueError, match=want):
        Engine.from_checkpoint(path)


def test_a_config_that_does_not_parse_is_refused(converted, tmp_path):
    path = shutil.copytree(converted, tmp_path / "edited")
    (path / "config.json").write_text('{"num_hidden_layers": 4,')
    with pytest.raises(ValueError, match=f"cannot read {re.escape(str(path / 'config.json'))}"):
        read_quantized_checkpoint(path)


def forge_tensor(converted, tmp_path, name, make):
    """A copy whose tensor `name` is make(QTensor), written with the sha256, size and
    checksum the manifest must then carry: only the checks against the plan can refuse it."""
    path = shutil.copytree(converted, tmp_path / "forged")
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    info = manifest["tensors"][name]
    shard = path / info["shard"]
    state = load_file(shard)
    q = make(QTensor.from_state_dict(state, name))
    state.update(q.to_state_dict(name))
    save_file(state, str(shard), metadata={"format": "mxrl-quantized"})
    manifest["shards"][info["shard"]].update(bytes=shard.stat().st_size, sha256=sha256_file(shard))
    info["hash"] = checksum(name, q)
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    return path


def test_a_forged_tensor_whose_fields_are_not_the_plans_is_refused(converted, tmp_path):
    """A per-expert global scale replaced by one scalar, sha256 and checksum rewritten."""

    def scalar(q):
        return dataclasses.replace(q, global_scale=q.global_scale.reshape(-1)[0].clone())

    path = forge_tensor(converted, tmp_path, GATE_UP, scalar)
    _, _, records = read_quantized_checkpoint(path)
    with pytest.raises(ValueError, match=re.escape(GATE_UP) + r": global_scale must be float32 "
                       r"\(8, 1, 1\) .*got float32 \(\)"):  # fmt: skip
        list(records)
    with pytest.raises(ValueError, match="model-0000"):  # the shard is named
        Engine.from_checkpoint(path)


def test_a_forged_nan_global_scale_is_refused_by_the_engine(converted, tmp_path):
    def nan(q):
        gs = q.global_scale.clone()
        gs[2] = float("nan")
        return dataclasses.replace(q, global_scale=gs)

    path = forge_tensor(converted, tmp_path, GATE_UP, nan)
    with pytest.raises(ValueError, match=re.escape(GATE_UP) + ": global_scale must be finite and "
                       r"positive.*got nan at index \(2, 0, 0\)"):  # fmt: skip
        Engine.from_checkpoint(path)
    assert torch.isnan(load_file(path / json.loads((path / MANIFEST_NAME).read_text())[
        "tensors"][GATE_UP]["shard"])[f"{GATE_UP}.global_scale"]).any()  # fmt: skip
