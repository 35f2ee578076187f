"""sync.export: buckets, hashes from the one export path, the quantization event, NaN refusal."""

import math

import pytest
import torch

from mxrl.formats import QTensor, dequantize
from mxrl.recipe import resolve
from mxrl.weights import QuantizationEvent, export, export_weights
from tests.sync.helpers import hashes, tiny

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)


def plan_of(model, preset):
    return resolve(preset, {n: p.shape for n, p in model.named_parameters()})


@pytest.mark.parametrize("bucket_bytes", [1, 20_000, 64 * 1024, 10**9])
def test_buckets_respect_the_limit_and_carry_the_plan_order(bucket_bytes):
    model = tiny()
    plan = plan_of(model, "nvfp4-dequantized")
    buckets = list(export(model, plan, bucket_bytes=bucket_bytes))
    n = len(buckets)
    for i, b in enumerate(buckets):
        assert b.index == i and b.plan_hash == plan.hash()
        assert b.nbytes <= bucket_bytes or b.num_tensors == 1, (i, b.nbytes)
        assert b.last == (i == n - 1)
        assert b.num_buckets == (n if b.last else None)
        if not b.last:  # filled: the next bucket's first record would not have fitted
            assert b.nbytes + buckets[i + 1].records[0].nbytes > bucket_bytes
    records = [r for b in buckets for r in b.records]
    assert [r.name for r in records] == list(plan)
    assert hashes(records) == hashes(export_weights(model.named_parameters(), plan))
    if bucket_bytes == 1:
        assert n == len(plan)
    if bucket_bytes == 10**9:
        assert n == 1


@pytest.mark.parametrize(("preset", "floor_db"), [("mxfp8", 25.0), ("nvfp4-dequantized", 15.0)])
def test_event_counts_bytes_and_gives_a_plausible_sqnr_per_layer(preset, floor_db):
    model = tiny()
    plan = plan_of(model, preset)
    seen = []
    exp = export(model, plan, bucket_bytes=50_000, step=7, on_event=seen.append)
    with pytest.raises(RuntimeError, match="iterate the export"):
        _ = exp.event
    records = list(exp.records())
    event = exp.event
    assert seen == [event]
    assert isinstance(event, QuantizationEvent)
    assert (event.step, event.plan_hash) == (7, plan.hash())
    assert event.num_tensors == len(plan) == len(records)
    assert event.num_bytes == sum(r.nbytes for r in records)
    assert event.seconds > 0
    # tiny-moe has 4 layers; "last 15%" keeps layer 3 in bf16, embedding and lm_head are bf16.
    assert list(event.sqnr_db) == ["layer.0", "layer.1", "layer.2"]
    for layer, db in event.sqnr_db.items():
        assert math.isfinite(db) and floor_db < db < 60, (layer, db)


def test_sqnr_is_the_aggregate_over_the_quantized_tensors_of_a_layer():
    model = tiny()
    plan = plan_of(model, "nvfp4-dequantized")
    exp = export(model, plan)
    records = {r.name: r.value for r in exp.records()}
    params = dict(model.named_parameters())
    signal = noise = 0.0
    for name, value in records.items():
        if plan[name].layer == 1 and isinstance(value, QTensor):
            ref = params[name].detach().double()
            signal += float((ref * ref).sum())
            noise += float(((ref - dequantize(value).double()) ** 2).sum())
    assert exp.event.sqnr_db["layer.1"] == pytest.approx(10 * math.log10(signal / noise), rel=1e-9)


def test_bf16_plan_has_no_quantized_tensor_to_measure():
    model = tiny()
    exp = export(model, plan_of(model, "bf16"))
    assert len(list(exp)) == 1
    assert exp.event.sqnr_db == {}
    assert exp.event.to_dict()["sqnr_db"] == {}


def test_event_round_trips_through_a_dict():
    event = QuantizationEvent(3, "ab" * 32, 5, 100, 0.5, {"layer.0": 20.0, "other": math.inf})
    d = event.to_dict()
    assert d["sqnr_db"]["other"] == "inf"
    assert QuantizationEvent.from_dict(d) == event


def test_an_export_is_one_event_and_iterates_once():
    model = tiny()
    exp = export(model, plan_of(model, "mxfp8"))
    list(exp)
    with pytest.raises(RuntimeError, match="iterated once"):
        iter(exp)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_master_weight_is_refused_before_any_bucket(bad):
    model = tiny()
    plan = plan_of(model, "nvfp4-dequantized")
    name = "model.layers.2.mlp.experts.down_proj"
    with torch.no_grad():
        dict(model.named_parameters())[name][3, 1, 4] = bad
    exp = export(model, plan)  # the check is queued; the first bucket reads its verdict
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.down_proj") as err:
        next(iter(exp))  # raises here: no bucket exists
    assert "Nothing was sent" in str(err.value)
    assert f"first model.layers.2.mlp.experts.3.down_proj.weight[1, 4] = {bad}" in str(err.value)


@pytest.mark.parametrize("bucket_bytes", [1, 10**9])
def test_the_check_is_read_once_by_the_first_bucket_and_covers_every_later_one(
    bucket_bytes, monkeypatch
):
    """export() queues the check and returns; the first bucket reads the verdict, once, for
    every tensor (a bad tensor of the last bucket is refused before the first one exists)."""
    from mxrl.weights import finite

    model = tiny()
    plan = plan_of(model, "mxfp8")
    reads = []
    real = finite.FiniteCheck.result
    monkeypatch.setattr(finite.FiniteCheck, "result", lambda self: reads.append(1) or real(self))
    exp = export(model, plan, bucket_bytes=bucket_bytes)
    assert reads == []  # not read by export(): the quantizers are queued without waiting
    buckets = list(exp)
    assert reads == [1] and len(buckets) == (len(plan) if bucket_bytes == 1 else 1)

    last = list(plan)[-1]
    with torch.no_grad():
        dict(model.named_parameters())[last].view(-1)[-1] = math.nan
    exp = export(model, plan, bucket_bytes=bucket_bytes)
    with pytest.raises(ValueError, match=f"refusing to export: 1 master weight.*{last}"):
        next(iter(exp))


def test_an_export_refuses_bad_arguments_before_returning():
    model = tiny()
    plan = plan_of(model, "mxfp8")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        export(model, plan, backend="nope")
    params = dict(model.named_parameters())
    params.pop(list(plan)[3])
    with pytest.raises(ValueError, match=r"the plan .* and the weights disagree"):
        export(params, plan)


def test_bucket_records_never_alias_bf16_master_weights():
    # A bf16 master exported as bf16 would be the parameter itself; the next optimizer step
    # would then change the engine's weights behind its back.
    model = tiny(dtype=torch.bfloat16)
    plan = plan_of(model, "bf16")
    records = list(export(model, plan).records())
    before = hashes(records)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    from mxrl.weights import checksum

    assert {r.name: checksum(r.name, r.value) for r in records} == before


def test_bad_arguments():
    model = tiny()
    plan = plan_of(model, "mxfp8")
    with pytest.raises(ValueError, match="bucket_bytes"):
        export(model, plan, bucket_bytes=0)
    with pytest.raises(TypeError, match="resolved"):
        export(model, "mxfp8")
    with pytest.raises(ValueError, match="disagree"):
        export({"model.norm.weight": torch.ones(64)}, plan)
