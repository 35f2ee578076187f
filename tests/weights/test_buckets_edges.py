"""Edges of the bucketed export (mxrl/weights/buckets.py), from the mutation run (issue 33,
docs/mutation/weights.buckets.md): what every bucket carries (index, step, plan hash, last,
num_buckets and the event on the last one only), the export's checksum map, the event's counts
and seconds (a fake clock, the intervals worked out by hand), sqnr off, the dtype and backend
passed on, and the refusals of `export`'s arguments, boundary by boundary."""

import importlib
import types

import pytest
import torch

from mxrl.formats import QTensor
from mxrl.recipe import resolve
from mxrl.weights import checksum, export

buckets_module = importlib.import_module("mxrl.weights.buckets")

Q = "model.layers.0.self_attn.q_proj.weight"  # mxfp8 under the mxfp8 preset
NORM = "model.layers.0.input_layernorm.weight"  # bf16
LAST = "model.layers.1.self_attn.q_proj.weight"  # bf16 (the last 15% of layers)


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        Q: torch.randn(64, 64, generator=g),  # mxfp8: 4096 + 128 bytes
        NORM: torch.randn(64, generator=g),  # bf16: 128 bytes
        LAST: torch.randn(64, 64, generator=g),  # bf16: 8192 bytes
    }


def plan_of(w, preset="mxfp8"):
    return resolve(preset, {n: t.shape for n, t in w.items()})


def test_each_bucket_carries_its_index_step_plan_hash_and_only_the_last_the_total():
    w = weights()
    plan = plan_of(w)
    assert [plan[n].format.value for n in plan] == ["mxfp8", "bf16", "bf16"]
    # 4224 + 128 = 4352 fits in 4352 exactly; 8192 more does not
    exp = export(w, plan, bucket_bytes=4352, step=5)
    out = list(exp)
    assert [[r.name for r in b.records] for b in out] == [[Q, NORM], [LAST]]
    assert [b.nbytes for b in out] == [4352, 8192]
    assert [b.num_tensors for b in out] == [2, 1]
    first, last = out
    assert (first.index, first.last, first.num_buckets, first.step, first.event) == (
        0, False, None, 5, None,
    )  # fmt: skip
    assert (last.index, last.last, last.num_buckets, last.step) == (1, True, 2, 5)
    assert last.event is exp.event
    assert first.plan_hash == last.plan_hash == exp.plan_hash == plan.hash()
    assert (exp.event.step, exp.event.plan_hash) == (5, plan.hash())
    assert (exp.event.num_tensors, exp.event.num_bytes) == (3, 4224 + 128 + 8192)
    assert exp.step == 5 and exp.bucket_bytes == 4352 and exp.plan is plan
    # every record's checksum, over both buckets, is the one of its name and bytes
    want = {r.name: checksum(r.name, r.value) for b in out for r in b.records}
    assert exp.hashes == want and len(want) == 3
    assert all(r.hash == want[r.name] for b in out for r in b.records)


def test_one_bucket_is_index_0_last_of_1():
    w = weights()
    (only,) = export(w, plan_of(w), bucket_bytes=10**6)
    assert (only.index, only.last, only.num_buckets, only.step) == (0, True, 1, 0)
    assert only.num_tensors == 3 and only.nbytes == 4224 + 128 + 8192


def test_the_first_record_alone_over_the_limit_opens_no_empty_bucket():
    """A first record bigger than the limit: no empty bucket before it; then 128 + 8192 is
    over 4000 again, so each record alone."""
    w = weights()
    out = list(export(w, plan_of(w), bucket_bytes=4000))
    assert [[r.name for r in b.records] for b in out] == [[Q], [NORM], [LAST]]
    assert [b.index for b in out] == [0, 1, 2] and out[-1].num_buckets == 3


def test_the_export_time_is_the_export_side_only(monkeypatch):
    """A clock that reads 1, 2, 4, 8, ... (each interval distinct): the event's seconds are
    the interval before export() returns (2 - 1), the first bucket's (8 - 4) and the last one's
    (32 - 16), not the time the consumer held the first bucket (16 - 8)."""
    ticks = iter(2.0**k for k in range(64))
    monkeypatch.setattr(
        buckets_module, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks))
    )
    w = weights()
    exp = export(w, plan_of(w), bucket_bytes=4352)
    assert len(list(exp)) == 2
    assert exp.event.seconds == 1 + 4 + 16


def test_on_event_gets_the_event_once_the_last_bucket_is_made():
    w = weights()
    seen = []
    exp = export(w, plan_of(w), bucket_bytes=4352, on_event=seen.append)
    it = iter(exp)
    next(it)
    assert seen == []
    last = next(it)
    assert seen == [last.event] and seen[0] is exp.event


def test_sqnr_is_measured_for_quantized_records_unless_off():
    w = weights()
    on = export(w, plan_of(w))
    list(on)
    assert list(on.event.sqnr_db) == ["layer.0"]  # the one mxfp8 tensor's layer
    assert 25 < on.event.sqnr_db["layer.0"] < 60
    off = export(w, plan_of(w), sqnr=False)
    list(off)
    assert off.event.sqnr_db == {}


def test_bf16_dtype_and_backend_are_passed_on():
    w = weights()
    exp = export(w, plan_of(w), bf16_dtype=torch.float16)
    assert exp.bf16_dtype is torch.float16
    values = {r.name: r.value for r in exp.records()}
    assert values[NORM].dtype is torch.float16 and values[LAST].dtype is torch.float16
    assert isinstance(values[Q], QTensor)
    default = {r.name: r.value for r in export(w, plan_of(w)).records()}
    assert default[NORM].dtype is torch.bfloat16
    with pytest.raises(ValueError, match="unknown kernel backend"):
        export(w, plan_of(w), backend="bogus")


def test_the_backend_is_checked_where_a_quantizer_runs_and_handed_to_the_quantizers(monkeypatch):
    """export() refuses an unknown backend before it returns when the plan quantizes a tensor
    (an all-bf16 plan runs no quantizer: nothing to refuse), and the quantizers get the
    backend asked for."""
    only_norm = {NORM: torch.ones(64)}
    exp = export(only_norm, resolve("mxfp8", {NORM: (64,)}), backend="bogus")
    assert [r.name for r in exp.records()] == [NORM]

    export_module = importlib.import_module("mxrl.weights.export")
    asked = []
    real = export_module.backend_for

    def spy(backend, device, *args):
        asked.append(backend)
        return real(None, device, *args)

    monkeypatch.setattr(export_module, "backend_for", spy)
    monkeypatch.setattr(buckets_module, "backend_for", spy)
    w = weights()  # Q is quantized (above: "bogus" refused before export() returns)
    list(export(w, plan_of(w), backend="mine"))
    assert asked and set(asked) == {"mine"}


@pytest.mark.parametrize("bucket_bytes", [0, -1, True, 1.5, 4352.0, "4352", None])
def test_bucket_bytes_must_be_a_positive_int(bucket_bytes):
    w = weights()
    with pytest.raises(ValueError, match="bucket_bytes must be a positive number of bytes"):
        export(w, plan_of(w), bucket_bytes=bucket_bytes)


@pytest.mark.parametrize("step", [-1, True, False, 1.0, "1", None])
def test_step_must_be_an_int_of_zero_or_more(step):
    w = weights()
    with pytest.raises(ValueError, match="step must be a training step"):
        export(w, plan_of(w), step=step)


def test_the_smallest_accepted_arguments():
    w = weights()
    out = list(export(w, plan_of(w), bucket_bytes=1, step=0))
    assert len(out) == 3 and {b.step for b in out} == {0}


def test_a_plan_must_be_resolved_and_not_empty():
    with pytest.raises(TypeError, match="resolved"):
        export(weights(), {})
    with pytest.raises(ValueError, match="holds no tensor"):
        export({}, resolve("mxfp8", {}))


def test_records_alone_are_the_buckets_records_in_order():
    w = weights()
    records = list(export(w, plan_of(w), bucket_bytes=1).records())
    assert [r.name for r in records] == [Q, NORM, LAST]


def test_a_plan_of_one_tensor_is_one_bucket():
    w = {NORM: torch.ones(64)}
    (only,) = export(w, plan_of(w))
    assert [r.name for r in only.records] == [NORM]
    assert (only.index, only.last, only.num_buckets, only.nbytes) == (0, True, 1, 128)


def test_pairs_and_a_mapping_are_exported_alike():
    w = weights()
    want = {r.name: r.hash for r in export(w, plan_of(w)).records()}
    assert {r.name: r.hash for r in export(list(w.items()), plan_of(w)).records()} == want
