"""Edges of writing a quantized checkpoint (mxrl/weights/quantized_checkpoint.py), from the
mutation run (issue 33, docs/mutation/weights.quantized_checkpoint.md), on three hand-made
tensors (no model built): the files, the safetensors header read by hand (an 8-byte
little-endian length, then JSON: each key's dtype, shape and data offsets, the metadata), the
manifest's fields worked out by hand, shard boundaries at the byte, the refusals of records that
are not the plan's, and what the caller's check, the side files and the progress bar see."""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import struct
import types

import pytest
import torch

import mxrl
from mxrl.recipe import Plan, resolve
from mxrl.weights import WeightRecord, checksum, export, export_weights
from mxrl.weights.quantized_checkpoint import write_quantized_checkpoint

qc = importlib.import_module("mxrl.weights.quantized_checkpoint")

Q = "model.layers.0.self_attn.q_proj.weight"  # mxfp8: 64 * 64 + 64 * 2 = 4224 bytes
NORM = "model.layers.0.input_layernorm.weight"  # bf16: 128 bytes
LAST = "model.layers.1.self_attn.q_proj.weight"  # bf16 (the last 15% of layers): 8192 bytes
SHARD = "model-{:05d}-of-{:05d}.safetensors"


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        Q: torch.randn(64, 64, generator=g),
        NORM: torch.randn(64, generator=g),
        LAST: torch.randn(64, 64, generator=g),
    }


def plan_of(w) -> Plan:
    return resolve("mxfp8", {n: t.shape for n, t in w.items()})


def records(w=None, plan=None) -> list[WeightRecord]:
    w = weights() if w is None else w
    return list(export_weights(w, plan_of(w) if plan is None else plan))


def header(path) -> dict:
    """The safetensors header: a little-endian u64 length, then that many bytes of JSON."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def test_the_files_manifest_and_shards_of_a_three_tensor_export(tmp_path):
    w = weights()
    plan = plan_of(w)
    recs = records(w, plan)
    config = {"b": 1, "a": [1]}
    # Q + NORM = 4352 bytes fill the first shard exactly; LAST gets the second
    out = write_quantized_checkpoint(recs, plan, config, tmp_path / "q", shard_bytes=4352)
    assert out == tmp_path / "q" and list(tmp_path.iterdir()) == [out]
    first, second = SHARD.format(1, 2), SHARD.format(2, 2)
    names = ["config.json", "manifest.json", first, second, "plan.json"]
    assert sorted(p.name for p in out.iterdir()) == names
    assert (out / "config.json").read_text() == '{\n  "a": [\n    1\n  ],\n  "b": 1\n}\n'
    text = (out / "plan.json").read_text()
    assert text.endswith("}\n") and Plan.from_json(text) == plan
    assert text.startswith('{\n  "') and text.splitlines()[-2].startswith("  ")  # indent 2
    m = json.loads((out / "manifest.json").read_text())
    assert m["format"] == "mxrl-quantized" and m["version"] == 3
    assert (m["mxrl_version"], m["recipe"], m["plan_hash"]) == (
        mxrl.__version__,
        "mxfp8",
        plan.hash(),
    )
    assert (m["num_tensors"], m["num_bytes"], m["quantization_event"]) == (
        3,
        4224 + 128 + 8192,
        None,
    )
    by_name = {r.name: r for r in recs}
    assert m["tensors"] == {
        Q: {"shard": first, "format": "mxfp8", "shape": [64, 64], "bytes": 4224,
            "hash": by_name[Q].hash, "keys": [f"{Q}.qdata", f"{Q}.scale"]},
        NORM: {"shard": first, "format": "bf16", "shape": [64], "bytes": 128,
               "hash": by_name[NORM].hash, "keys": [NORM]},
        LAST: {"shard": second, "format": "bf16", "shape": [64, 64], "bytes": 8192,
               "hash": by_name[LAST].hash, "keys": [LAST]},
    }  # fmt: skip
    for shard, count in [(first, 2), (second, 1)]:
        raw = (out / shard).read_bytes()
        assert m["shards"][shard] == {
            "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(), "num_tensors": count,
        }  # fmt: skip
    h = header(out / first)
    assert h.pop("__metadata__") == {"format": "mxrl-quantized"}
    fields = {
        k: (v["dtype"], v["shape"], v["data_offsets"][1] - v["data_offsets"][0])
        for k, v in h.items()
    }
    assert fields == {
        f"{Q}.qdata": ("U8", [64, 64], 4096),
        f"{Q}.scale": ("F8_E8M0", [64, 2], 128),
        NORM: ("BF16", [64], 128),
    }
    assert sorted(header(out / second)) == ["__metadata__", LAST]


def test_the_manifest_has_one_line_per_tensor_in_plan_order(tmp_path):
    w = weights()
    plan = plan_of(w)
    recs = records(w, plan)
    out = write_quantized_checkpoint(recs[::-1], plan, {}, tmp_path / "q")  # any record order
    lines = (out / "manifest.json").read_text().splitlines()
    start = lines.index('  "tensors": {')
    assert [line.split(":")[0] for line in lines[start + 1 : start + 4]] == [
        f'    "{Q}"', f'    "{NORM}"', f'    "{LAST}"',
    ]  # fmt: skip
    assert lines[start + 4 :] == ["  }", "}"] and lines[0] == "{"
    assert lines[1] == '  "format": "mxrl-quantized",'  # indented by two, as the tensors
    assert json.loads(lines[start + 2].split(": ", 1)[1].rstrip(","))["keys"] == [NORM]
    m = json.loads((out / "manifest.json").read_text())
    assert (
        list(m["shards"]) == [SHARD.format(1, 1)]
        and m["shards"][SHARD.format(1, 1)]["num_tensors"] == 3
    )


@pytest.mark.parametrize(
    ("shard_bytes", "shards"),
    [
        (4351, [[Q], [NORM], [LAST]]),  # one byte short: Q alone, NORM + LAST (8320) too big
        (4352, [[Q, NORM], [LAST]]),
        (12543, [[Q, NORM], [LAST]]),  # one byte short of all three
        (12544, [[Q, NORM, LAST]]),  # every byte
        (1, [[Q], [NORM], [LAST]]),  # each record bigger than the limit: a shard of its own
        ("12KB", [[Q, NORM], [LAST]]),  # 12000 bytes
    ],
)
def test_shards_fill_in_order_up_to_exactly_the_limit(tmp_path, shard_bytes, shards):
    w = weights()
    plan = plan_of(w)
    out = write_quantized_checkpoint(records(w, plan), plan, {}, tmp_path / "q", shard_bytes)
    m = json.loads((out / "manifest.json").read_text())
    n = len(shards)
    assert list(m["shards"]) == [SHARD.format(i, n) for i in range(1, n + 1)]
    for i, names in enumerate(shards, start=1):
        assert [
            t for t, info in m["tensors"].items() if info["shard"] == SHARD.format(i, n)
        ] == names
        assert sorted(k for k in header(out / SHARD.format(i, n)) if k != "__metadata__") == sorted(
            k for t in names for k in m["tensors"][t]["keys"]
        )


def test_a_shard_after_the_first_also_fills_to_exactly_the_limit(tmp_path):
    """Records in another order than the plan's: LAST (8192 bytes, over the limit) alone, then
    Q + NORM = 4352 bytes, exactly the limit, in the second shard."""
    w = weights()
    plan = plan_of(w)
    q, norm, last = records(w, plan)
    out = write_quantized_checkpoint([last, q, norm], plan, {}, tmp_path / "q", shard_bytes=4352)
    tensors = json.loads((out / "manifest.json").read_text())["tensors"]
    assert {n: t["shard"] for n, t in tensors.items()} == {
        LAST: SHARD.format(1, 2), Q: SHARD.format(2, 2), NORM: SHARD.format(2, 2),
    }  # fmt: skip


def test_an_exports_event_goes_into_the_manifest(tmp_path):
    w = weights()
    plan = plan_of(w)
    exp = export(w, plan, step=3)
    out = write_quantized_checkpoint(exp, plan, {}, tmp_path / "q")
    event = json.loads((out / "manifest.json").read_text())["quantization_event"]
    assert (event["step"], event["plan_hash"], event["num_tensors"]) == (3, plan.hash(), 3)
    assert event["num_bytes"] == 4224 + 128 + 8192 and list(event["sqnr_db"]) == ["layer.0"]


def _refused(tmp_path, recs, plan, match):
    with pytest.raises(ValueError, match=match):
        write_quantized_checkpoint(recs, plan, {}, tmp_path / "q")
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left behind


def test_records_that_are_not_the_plans_are_refused_writing_nothing(tmp_path):
    w = weights()
    plan = plan_of(w)
    q, norm, last = records(w, plan)
    _refused(
        tmp_path, [q, norm], plan, r"lack 1 tensor\(s\) of the plan, e\.g\. \['model\.layers\.1"
    )
    _refused(tmp_path, [q, q, norm, last], plan, "appears twice")
    other = WeightRecord("extra.weight", norm.value, checksum("extra.weight", norm.value))
    _refused(tmp_path, [q, other, norm, last], plan, "'extra.weight' is not a tensor of the plan")
    _refused(
        tmp_path, [q, WeightRecord(NORM, norm.value, "0" * 64), last], plan, "checksum mismatch"
    )
    as_norm = WeightRecord(NORM, q.value, checksum(NORM, q.value))  # an mxfp8 value for a bf16 spec
    _refused(tmp_path, [q, as_norm, last], plan, NORM)


def test_each_value_is_written_as_it_was_checked_even_a_strided_view(tmp_path):
    """The records are checked (their checksums) as they come and written when their shard
    fills: a value its producer changes in place after handing it over, or a column-major view
    (safetensors takes contiguous tensors only), is written as the bytes that were checked."""
    from safetensors.torch import load_file

    w = weights()
    plan = plan_of(w)
    q, _, _ = records(w, plan)
    base = torch.arange(64 + 64 * 64, dtype=torch.bfloat16)
    norm, last = base[:64], base[64:].view(64, 64).t()  # one storage; the second column-major
    want_norm, want_last = norm.clone(), last.clone()

    def produced():
        yield q
        yield WeightRecord(NORM, norm, checksum(NORM, norm))
        yield WeightRecord(LAST, last, checksum(LAST, last))
        base.add_(1)  # the producer reuses its buffer once the records are handed over

    out = write_quantized_checkpoint(produced(), plan, {}, tmp_path / "q")
    state = load_file(out / SHARD.format(1, 1))
    assert torch.equal(state[NORM], want_norm) and torch.equal(state[LAST], want_last)
    assert torch.equal(state[f"{Q}.qdata"], q.value.qdata)


def test_the_callers_check_runs_once_on_the_complete_files_before_they_are_in_place(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer_config.json").write_text("{}\n")
    seen = []

    def check():
        staged = [p for p in tmp_path.iterdir() if p.name not in ("hf",)]
        seen.append((not (tmp_path / "q").exists(), sorted(p.name for p in staged[0].iterdir())))

    out = write_quantized_checkpoint(records(), plan_of(weights()), {}, tmp_path / "q",
                                     copy_files_from=tmp_path / "hf", check=check)  # fmt: skip
    files = [
        "config.json",
        "manifest.json",
        SHARD.format(1, 1),
        "plan.json",
        "tokenizer_config.json",
    ]
    assert seen == [(True, files)]
    assert sorted(p.name for p in out.iterdir()) == files

    def refuse():
        raise RuntimeError("the engine's digest differs")

    with pytest.raises(RuntimeError, match="digest"):
        write_quantized_checkpoint(records(), plan_of(weights()), {}, tmp_path / "r", check=refuse)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "q"]


def test_an_existing_checkpoint_is_replaced_only_when_asked(tmp_path):
    w = weights()
    plan = plan_of(w)
    out = write_quantized_checkpoint(records(w, plan), plan, {"v": 1}, tmp_path / "q")
    with pytest.raises(ValueError, match=r"pass overwrite=True \(--overwrite\) to replace it"):
        write_quantized_checkpoint(records(w, plan), plan, {"v": 2}, out)
    assert json.loads((out / "config.json").read_text()) == {"v": 1}
    write_quantized_checkpoint(records(w, plan), plan, {"v": 2}, out, overwrite=True)
    assert json.loads((out / "config.json").read_text()) == {"v": 2}


@pytest.mark.parametrize(
    ("progress", "terminal", "shown"),
    [(True, False, True), (False, True, False), (None, False, False), (None, True, True)],
)
def test_the_progress_bar_shows_when_asked_or_on_a_terminal(
    tmp_path, capsys, monkeypatch, progress, terminal, shown
):
    """progress=None: the bar shows when stderr is a terminal (the writer asks its own `sys`,
    stood in for here; the bar itself goes to the captured stderr)."""
    stderr = types.SimpleNamespace(isatty=lambda: terminal)
    monkeypatch.setattr(qc, "sys", types.SimpleNamespace(stderr=stderr))
    w = weights()
    plan = plan_of(w)
    write_quantized_checkpoint(records(w, plan), plan, {}, tmp_path / "q", 4352, progress=progress)
    err = capsys.readouterr().err
    bar = re.search(r"(^|\r)converting: 100%\|.*\| 3/3 \[.*tensor/s, shard 2\]", err)
    assert (bar is not None) == shown
    assert err == "" or shown
