"""Edges of reading a quantized checkpoint (mxrl/weights/quantized_checkpoint.py), from the
mutation run (issue 33, docs/mutation/weights.quantized_checkpoint.md): a two-layer dense Qwen3
(its config.json written here, its weights random tensors of the shapes that config gives: no
model built) converted to MXFP8 in three shards, read back, then edited file by file; each
refusal names the file, and the tensor where the file still parses."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import re

import pytest
import torch
import torch._dynamo

from mxrl.formats import QTensor
from mxrl.recipe import resolve
from mxrl.weights import export_weights, read_quantized_checkpoint, write_quantized_checkpoint
from mxrl.weights.check import _model_shapes

qc = importlib.import_module("mxrl.weights.quantized_checkpoint")
# torch._dynamo is imported above, with the module, because the first model built on the meta
# device (check_config's shapes) imports it lazily: 6 s in every process that reads a
# checkpoint, once per mutant under mutmut's forked workers, instead of once

CONFIG = {
    "model_type": "qwen3", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
    "intermediate_size": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 64, "tie_word_embeddings": True,
}  # fmt: skip
Q = "model.layers.0.self_attn.q_proj.weight"  # mxfp8, in the first shard
EMBED = "model.embed_tokens.weight"  # bf16, the first tensor
LAST = "model.norm.weight"  # bf16, the last tensor (third shard)
FIRST, THIRD = "model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"


def write(tmp_path):
    """The checkpoint (in tmp_path / "q"), its plan and records."""
    shapes = _model_shapes(CONFIG)
    plan = resolve("mxfp8", shapes)
    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    records = list(export_weights(w, plan))
    out = write_quantized_checkpoint(records, plan, CONFIG, tmp_path / "q", shard_bytes=40_000)
    return out, plan, records


def manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def edit_manifest(path, edit) -> None:
    m = manifest(path)
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_a_checkpoint_reads_back_as_its_plan_config_and_records(tmp_path):
    path, plan, records = write(tmp_path)
    assert sorted(manifest(path)["shards"])[::2] == [FIRST, THIRD]
    got_plan, config, got = read_quantized_checkpoint(str(path))
    assert got_plan == plan and config == CONFIG
    got = list(got)
    assert [r.name for r in got] == list(plan)
    hashes = {n: t["hash"] for n, t in manifest(path)["tensors"].items()}
    for want, r in zip(records, got, strict=True):
        assert r.hash == hashes[r.name] == want.hash
        if isinstance(want.value, QTensor):
            assert r.value.fmt == want.value.fmt and r.value.shape == want.value.shape
            assert torch.equal(r.value.qdata, want.value.qdata)
            assert torch.equal(r.value.scale.view(torch.uint8), want.value.scale.view(torch.uint8))
        else:
            assert r.value.dtype == torch.bfloat16 and torch.equal(r.value, want.value)


def test_not_a_directory_and_missing_or_unreadable_manifests_are_refused(tmp_path):
    path, _, _ = write(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        read_quantized_checkpoint(path / "config.json")
    (path / "manifest.json").write_text("{")
    with pytest.raises(ValueError, match=f"cannot read {re.escape(str(path / 'manifest.json'))}"):
        read_quantized_checkpoint(path)
    (path / "manifest.json").unlink()
    with pytest.raises(ValueError, match=r"manifest\.json is missing"):
        read_quantized_checkpoint(path)


@pytest.mark.parametrize(
    "fields", [{"format": "safetensors"}, {"version": 2}, {"version": 4}, {"format": None}]
)
def test_a_manifest_of_another_format_or_version_is_refused(tmp_path, fields):
    path, _, _ = write(tmp_path)
    edit_manifest(path, lambda m: m.update(fields))
    with pytest.raises(ValueError, match="is not a mxrl-quantized v3 manifest"):
        read_quantized_checkpoint(path)


def test_a_missing_broken_tampered_or_other_plan_is_refused(tmp_path):
    path, plan, _ = write(tmp_path)
    text = (path / "plan.json").read_text()
    plan_file = re.escape(str(path / "plan.json"))
    odd = {"schema": 1, "recipe_name": "x", "backward": "dequantized", "num_layers": 2,
           "tensors": [{"bogus": 1}]}  # fmt: skip
    # not JSON, not an object, a field missing, a tensor of unknown fields
    for broken in ["{", "[]", '{"schema": 1}', json.dumps(odd)]:
        (path / "plan.json").write_text(broken)
        with pytest.raises(ValueError, match=f"cannot read {plan_file}"):
            read_quantized_checkpoint(path)
    data = json.loads(text)
    data["hash"] = "0" * 64  # the plan's own hash no longer matches its specs
    (path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"^{plan_file}: ") as err:
        read_quantized_checkpoint(path)
    assert "cannot read" not in str(err.value)
    other = resolve("bf16", {n: s.shape for n, s in plan.items()})
    (path / "plan.json").write_text(other.to_json())
    with pytest.raises(ValueError, match="from different conversions"):
        read_quantized_checkpoint(path)
    (path / "plan.json").unlink()
    with pytest.raises(ValueError, match=f"cannot read {plan_file}"):
        read_quantized_checkpoint(path)


def test_the_config_must_be_there_and_describe_the_plans_model(tmp_path):
    path, _, _ = write(tmp_path)
    (path / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"config\.json: num_hidden_layers is 3"):
        read_quantized_checkpoint(path)
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json is missing"):
        read_quantized_checkpoint(path)


def test_a_manifest_listing_other_tensors_than_the_plan_is_refused(tmp_path):
    path, _, _ = write(tmp_path)
    m = manifest(path)
    edit_manifest(path, lambda m: m["tensors"].pop(LAST))
    with pytest.raises(ValueError, match=r"list different tensors: \['model\.norm\.weight'\]"):
        read_quantized_checkpoint(path)
    edit_manifest(path, lambda x: x["tensors"].update({LAST: m["tensors"][LAST], "x": {}}))
    with pytest.raises(ValueError, match=r"list different tensors: \['x'\]"):
        read_quantized_checkpoint(path)


def test_missing_misplaced_and_truncated_shards_are_refused_before_any_record(tmp_path):
    path, _, _ = write(tmp_path)
    raw = (path / THIRD).read_bytes()
    (path / THIRD).write_bytes(raw[:-1])
    with pytest.raises(
        ValueError, match=rf"{THIRD} has {len(raw) - 1} bytes, the manifest says {len(raw)}"
    ):
        read_quantized_checkpoint(path)
    (path / THIRD).unlink()
    with pytest.raises(ValueError, match=rf"shard .*{THIRD} is missing"):
        read_quantized_checkpoint(path)
    # a shard named by a path (even one that exists) is not a file of this checkpoint
    (path / "sub").mkdir()
    (path / "sub" / THIRD).write_bytes(raw)

    def elsewhere(m):
        m["shards"][f"sub/{THIRD}"] = m["shards"].pop(THIRD)

    edit_manifest(path, elsewhere)
    with pytest.raises(ValueError, match=rf"sub/{THIRD} is missing"):
        read_quantized_checkpoint(path)


def data_start(path, key) -> int:
    """Offset of `key`'s first data byte (8-byte header length, the header, then the data)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n + json.loads(raw[8 : 8 + n])[key]["data_offsets"][0]


def test_a_changed_byte_is_found_when_its_shard_is_reached_naming_the_tensor(tmp_path):
    path, plan, _ = write(tmp_path)
    raw = bytearray((path / THIRD).read_bytes())
    raw[data_start(path / THIRD, LAST) + 1] ^= 0x10
    (path / THIRD).write_bytes(bytes(raw))
    _, _, records = read_quantized_checkpoint(path)  # sizes are right: found when read
    tensors = manifest(path)["tensors"]
    fine = [n for n in plan if tensors[n]["shard"] != THIRD]  # the other shards are fine
    assert 0 < len(fine) < len(plan) - 1
    assert [next(records).name for _ in fine] == fine
    with pytest.raises(ValueError, match=rf"{THIRD} does not match its sha256") as err:
        next(records)
    assert f"tensor(s) {LAST} differ from their manifest checksum" in str(err.value)


def test_a_corruption_report_names_the_first_five_changed_tensors_in_shard_order(tmp_path):
    path, plan, _ = write(tmp_path)
    tensors = manifest(path)["tensors"]
    changed = [n for n in plan if tensors[n]["shard"] == FIRST][:6]
    assert len(changed) == 6
    raw = bytearray((path / FIRST).read_bytes())
    for name in changed:
        raw[data_start(path / FIRST, tensors[name]["keys"][0])] ^= 0x01
    (path / FIRST).write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="does not match its sha256") as err:
        next(read_quantized_checkpoint(path)[2])
    assert f"tensor(s) {', '.join(changed[:5])} differ from" in str(err.value)
    assert changed[5] not in str(err.value)


def test_a_shard_that_no_longer_parses_is_reported_without_tensor_names(tmp_path):
    path, _, _ = write(tmp_path)
    size = (path / THIRD).stat().st_size
    (path / THIRD).write_bytes(b"\xff" * size)
    _, _, records = read_quantized_checkpoint(path)
    with pytest.raises(
        ValueError, match=r"does not match its sha256 in manifest\.json\. The file"
    ) as e:
        list(records)
    assert "tensor(s)" not in str(e.value)
    assert str(e.value).endswith("The file is corrupt; copy it again or re-run mxrl convert")


def test_a_manifest_naming_keys_the_shard_lacks_is_refused_naming_the_tensor(tmp_path):
    path, _, _ = write(tmp_path)
    edit_manifest(path, lambda m: m["tensors"][EMBED].update(keys=[f"{EMBED}.nothing"]))
    with pytest.raises(ValueError, match=rf"{FIRST}: cannot read {re.escape(EMBED)}"):
        list(read_quantized_checkpoint(path)[2])
    path2, _, _ = write(tmp_path / "2")
    edit_manifest(path2, lambda m: m["tensors"][Q].update(keys=[f"{Q}.qdata"]))  # no scale
    with pytest.raises(ValueError, match=rf"{FIRST}: {re.escape(Q)} is not a QTensor"):
        list(read_quantized_checkpoint(path2)[2])


def test_a_tensor_whose_fields_are_not_the_plans_is_refused_naming_the_shard(tmp_path):
    """The embedding rewritten flat (4096 values, not 64 x 64) with the shard's sha256 and size
    put right: only the check of the record against the plan can refuse it."""
    from safetensors.torch import load_file, save_file

    path, _, _ = write(tmp_path)
    state = load_file(path / FIRST)
    state[EMBED] = state[EMBED].reshape(-1).clone()
    save_file(state, str(path / FIRST))
    raw = (path / FIRST).read_bytes()
    edit_manifest(path, lambda m: m["shards"][FIRST].update(
        bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest()))  # fmt: skip
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path / FIRST))}: {re.escape(EMBED)}"):
        list(read_quantized_checkpoint(path)[2])


def test_the_sha256_of_a_file_is_read_in_chunks_of_hash_chunk_bytes(monkeypatch):
    """Shards are gigabytes: the digest reads them _HASH_CHUNK bytes at a time (7 here: 110
    whole chunks and one of 2 bytes), not whole."""
    data = bytes(range(256)) * 3 + b"tail"
    reads = []

    class File(io.BytesIO):
        def read(self, size=-1):
            reads.append(size)
            return super().read(size)

    class Stored:
        def __init__(self, content):
            self.content = content

        def open(self, mode):
            assert mode == "rb"
            return File(self.content)

    monkeypatch.setattr(qc, "_HASH_CHUNK", 7)
    assert qc.sha256_file(Stored(data)) == hashlib.sha256(data).hexdigest()
    assert reads == [7] * (len(data) // 7 + 2)  # the partial chunk, then the empty read
    assert qc.sha256_file(Stored(b"")) == hashlib.sha256(b"").hexdigest()
