"""save_pretrained / from_pretrained: bit-identical round trips, sharding, dtype, and errors."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mxrl.arch import builtin_config
from mxrl.models import build_model, from_pretrained, hf_save, parse_size, save_pretrained
from mxrl.weights import convert_checkpoint
from tests.models.configs import CONFIGS
from tests.numerics import assert_bytes_equal

TINY = builtin_config("tiny-moe")


def _assert_same_model(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert_bytes_equal(sb[k], sa[k], k)


def _file_tensors(path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(f)
    return out


def _shards(path):
    return sorted(path.glob("model-*-of-*.safetensors"))


@pytest.fixture(scope="module")
def tiny():
    return build_model(TINY, seed=0)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_identical_with_shards(tmp_path, layout, dtype):
    model = build_model(TINY, dtype=dtype, seed=1)
    out = save_pretrained(model, tmp_path / "ck", layout, max_shard_size="30KB", progress=False)
    files = sorted(p.name for p in out.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in files
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = _file_tensors(out)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    fused_keys = [k for k in tensors if k.endswith("experts.gate_up_proj")]
    assert bool(fused_keys) == (layout == "fused")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert {k: config[k] for k in TINY} == TINY
    loaded = from_pretrained(out, dtype=dtype, progress=False)
    _assert_same_model(model, loaded)
    # and the per-expert tensors on disk are the exact slices of the fused parameters
    if layout == "per_expert":
        gate_up = model.state_dict()["model.layers.2.mlp.experts.gate_up_proj"]
        assert_bytes_equal(tensors["model.layers.2.mlp.experts.5.up_proj.weight"], gate_up[5, 32:])


def test_single_file_and_dtype_conversion(tmp_path, tiny):
    out = save_pretrained(tiny, tmp_path / "ck", dtype=torch.bfloat16, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    loaded = from_pretrained(out, dtype=torch.float32, progress=False)  # bf16 -> fp32 on load
    for k, v in tiny.state_dict().items():
        assert_bytes_equal(loaded.state_dict()[k], v.to(torch.bfloat16).float(), k)


def test_tied_checkpoint_with_or_without_lm_head(tmp_path):
    model = build_model(CONFIGS["qwen3_moe-nonorm-tied"], seed=0)
    out = save_pretrained(model, tmp_path / "ck", progress=False)
    state = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(out / "model.safetensors"))
    _assert_same_model(model, from_pretrained(out, progress=False))
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tie_word_embeddings.*lm_head\.weight"):
        from_pretrained(out, progress=False)


# --- errors ---------------------------------------------------------------------------------


def _edit_single(tmp_path, tiny, edit):
    out = save_pretrained(tiny, tmp_path / "ck", progress=False)
    state = load_file(out / "model.safetensors")
    edit(state)
    save_file(state, str(out / "model.safetensors"))
    return out


def test_nan_in_a_per_expert_checkpoint_is_named_by_its_key_in_the_file(tmp_path, tiny):
    out = save_pretrained(tiny, tmp_path / "ck", max_shard_size="400KB", progress=False)
    key = "model.layers.2.mlp.experts.3.up_proj.weight"
    shard = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][key]
    state = load_file(shard)
    state[key][13, 33] = float("nan")
    state[key][20, 0] = float("inf")
    save_file(state, str(shard))
    want = (
        f"{key} in {shard.name} holds nan at index (13, 33) (2 non-finite value(s) in that "
        "tensor). The checkpoint holds NaN/Inf"
    )
    with pytest.raises(ValueError, match=re.escape(want)) as e:
        from_pretrained(out, progress=False)
    assert "check_finite=False" in str(e.value) and "gate_up_proj" not in str(e.value)
    with pytest.raises(ValueError, match=re.escape(want)):  # mxrl convert loads it the same way
        convert_checkpoint(out, "nvfp4-dequantized", tmp_path / "q", progress=False)
    assert not (tmp_path / "q").exists()
    loaded = from_pretrained(out, check_finite=False, progress=False)  # the opt-out
    gate_up = loaded.state_dict()["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.isnan(gate_up[3, 32 + 13, 33])  # up is the second half


def test_inf_in_a_fused_checkpoint_and_overflow_on_load(tmp_path, tiny):
    out = save_pretrained(tiny, tmp_path / "fused", "fused", progress=False)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    state = load_file(out / "model.safetensors")
    state[key][5, 60, 7] = -float("inf")
    save_file(state, str(out / "model.safetensors"))
    want = f"{key} in model.safetensors holds -inf at index (5, 60, 7) (1 non-finite value(s)"
    with pytest.raises(ValueError, match=re.escape(want)):
        from_pretrained(out, progress=False)
    state[key][5, 60, 7] = 1e6  # finite in the fp32 file, Inf in fp16
    save_file(state, str(out / "model.safetensors"))
    from_pretrained(out, progress=False)
    with pytest.raises(
        ValueError,
        match=r"holds 1000000\.0 at index \(5, 60, 7\), which overflows to inf in torch\.float16",
    ):
        from_pretrained(out, dtype=torch.float16, progress=False)


def test_unknown_keys_are_named_with_a_count(tmp_path, tiny):
    def edit(state):
        for i in range(7):
            state[f"model.layers.0.mlp.bogus{i}.weight"] = torch.zeros(2)
        state["model.layers.0.mlp.experts.8.gate_proj.weight"] = torch.zeros(32, 64)  # E = 8

    with pytest.raises(ValueError, match=r"8 unknown tensors: .*and 3 more\. Fix: config\.json"):
        from_pretrained(_edit_single(tmp_path, tiny, edit), progress=False)


def test_missing_keys_and_incomplete_experts(tmp_path, tiny):
    def edit(state):
        del state["model.layers.1.self_attn.k_norm.weight"]
        del state["model.layers.3.mlp.experts.6.up_proj.weight"]

    with pytest.raises(ValueError) as e:
        from_pretrained(_edit_single(tmp_path, tiny, edit), progress=False)
    msg = str(e.value)
    assert "2 tensors missing" in msg and "model.layers.1.self_attn.k_norm.weight" in msg
    assert "model.layers.3.mlp.experts.gate_up_proj (experts 6 incomplete)" in msg


def test_wrong_shape(tmp_path, tiny):
    def edit(state):
        state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 32)

    with pytest.raises(ValueError, match=r"q_proj.weight: \[64, 32\], expected \[64, 64\]"):
        from_pretrained(_edit_single(tmp_path, tiny, edit), progress=False)


def test_expert_in_both_layouts_is_a_duplicate(tmp_path, tiny):
    def edit(state):
        state["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(8, 64, 64)

    with pytest.raises(ValueError, match="duplicated tensors"):
        from_pretrained(_edit_single(tmp_path, tiny, edit), progress=False)


def test_same_key_in_two_shards(tmp_path, tiny):
    out = save_pretrained(tiny, tmp_path / "ck", max_shard_size="400KB", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    extra = load_file(out / second)
    state = load_file(out / first)
    key = next(iter(extra))
    state[key] = extra[key]
    save_file(state, str(out / first))
    with pytest.raises(ValueError, match=f"duplicated tensors: {key} \\(in "):
        from_pretrained(out, progress=False)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_file_is_named(tmp_path, tiny, damage):
    out = save_pretrained(tiny, tmp_path / "ck", max_shard_size="400KB", progress=False)
    victim = _shards(out)[1]
    data = victim.read_bytes()
    victim.write_bytes(
        {"truncate": data[: len(data) // 2], "garbage": b"\x10" + data[1:40], "empty": b""}[damage]
    )
    with pytest.raises(ValueError, match=f"cannot read safetensors file .*{victim.name}"):
        from_pretrained(out, progress=False)


def test_missing_shard_and_missing_weights(tmp_path, tiny):
    out = save_pretrained(tiny, tmp_path / "ck", max_shard_size="400KB", progress=False)
    last = _shards(out)[-1]
    last.unlink()
    with pytest.raises(ValueError, match=f"lists shard '{last.name}'"):
        from_pretrained(out, progress=False)
    (out / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match=r"no model\.safetensors or .*index\.json.*shards need"):
        from_pretrained(out, progress=False)
    with pytest.raises(ValueError, match="not a directory"):
        from_pretrained(out / "config.json", progress=False)


def test_failed_save_leaves_nothing(tmp_path, tiny, monkeypatch):
    calls = []

    def fail_on_second_shard(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(hf_save, "save_file", fail_on_second_shard)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(tiny, tmp_path / "ck", max_shard_size="400KB", progress=False)
    assert os.listdir(tmp_path) == []


def test_existing_directory_needs_overwrite_and_survives_a_failed_save(tmp_path, tiny, monkeypatch):
    out = save_pretrained(tiny, tmp_path / "ck", progress=False)
    with pytest.raises(ValueError, match="overwrite=True"):
        save_pretrained(tiny, out, progress=False)
    before = (out / "model.safetensors").read_bytes()

    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(hf_save, "save_file", boom)
    with pytest.raises(RuntimeError):
        save_pretrained(tiny, out, overwrite=True, progress=False)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ck"] and (out / "model.safetensors").read_bytes() == before
    other = build_model(TINY, seed=9)
    save_pretrained(other, out, overwrite=True, progress=False)
    assert os.listdir(tmp_path) == ["ck"]
    _assert_same_model(other, from_pretrained(out, progress=False))


def test_side_files_are_copied(tmp_path, tiny):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "unrelated.txt").write_text("x")
    out = save_pretrained(tiny, tmp_path / "ck", copy_files_from=src, progress=False)
    assert (out / "tokenizer.json").read_text() == "{}" and not (out / "unrelated.txt").exists()


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500mb") == 500 * 10**6 and parse_size(123) == 123
    for bad in ("5XB", "-1GB", 0, "", True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
