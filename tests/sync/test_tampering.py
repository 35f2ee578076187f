"""Tampered updates are refused and the engine keeps serving its previous weights, untouched
(same bytes, same buffers, same logits): a flipped byte, a truncated bucket or payload, a wrong
plan, a stale record or bucket, reordered records or buckets. On the CPU, and the same on CUDA
(records exported and checksummed on the GPU)."""

import dataclasses

import pytest
import torch

from mxrl.engine import Engine
from mxrl.formats import QTensor
from mxrl.recipe import resolve
from mxrl.sync import InProcessTransport, pack_bucket, unpack_bucket
from mxrl.weights import WeightRecord, export
from tests.engine.test_load_in_place import forward_tensors
from tests.sync.helpers import engine_logits, hashes, tiny

PRESET = "nvfp4-dequantized"
BUCKET_BYTES = 30_000
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def engine(device):
    return Engine(tiny(seed=0).to(device), PRESET, device=device)


def buckets_of(device, seed=1, step=1, plan=None, engine=None):
    model = tiny(seed=seed).to(device)
    return list(export(model, plan or engine.plan, bucket_bytes=BUCKET_BYTES, step=step))


def refused(engine, buckets, match):
    held = hashes(engine.records())
    version, logits, storage = (
        engine.weights_version,
        engine_logits(engine),
        forward_tensors(engine),
    )
    with pytest.raises(ValueError, match=match):
        InProcessTransport(engine).send(buckets)
    assert engine.weights_version == version
    assert hashes(engine.records()) == held
    assert forward_tensors(engine) == storage
    assert torch.equal(engine_logits(engine), logits)


def replace_record(buckets, name, how):
    out = []
    for b in buckets:
        records = tuple(how(r) if r.name == name else r for r in b.records)
        out.append(dataclasses.replace(b, records=records))
    return out


def late_quantized(buckets) -> str:
    """A quantized record in a late bucket: every bucket before it has been checked already."""
    names = [r.name for b in buckets for r in b.records if isinstance(r.value, QTensor)]
    return names[-1]


def test_a_flipped_byte(engine, device):
    buckets = buckets_of(device, engine=engine)

    def flip(r):
        qdata = r.value.qdata.clone()
        qdata.view(-1)[-1] ^= 0x01
        return WeightRecord(r.name, dataclasses.replace(r.value, qdata=qdata), r.hash)

    refused(engine, replace_record(buckets, late_quantized(buckets), flip), "checksum mismatch")


def test_a_truncated_bucket(engine, device):
    buckets = buckets_of(device, engine=engine)
    assert len(buckets) > 3
    cut = dataclasses.replace(buckets[1], records=buckets[1].records[:-1])
    refused(engine, [buckets[0], cut, *buckets[2:]], "incomplete update")
    header, payload = pack_bucket(buckets[1], device)
    with pytest.raises(ValueError, match="payload bytes"):
        unpack_bucket(header, payload[:-16])
    name = buckets[2].records[0].name

    def shorter(r):  # a record whose tensor lost its tail, carrying the full tensor's checksum
        v = r.value
        if isinstance(v, QTensor):
            return WeightRecord(r.name, QTensor(v.qdata[:-1], v.scale[:-1], v.fmt,
                                                (v.shape[0] - 1, *v.shape[1:]),
                                                v.axis, v.global_scale), r.hash)  # fmt: skip
        return WeightRecord(r.name, v[:-1], r.hash)

    refused(engine, replace_record(buckets, name, shorter), name.replace(".", r"\."))


def test_a_wrong_plan(engine, device):
    other = resolve("mxfp8", {n: p.shape for n, p in tiny().named_parameters()})
    refused(engine, buckets_of(device, plan=other), "plan hash mismatch")


def test_a_stale_record_or_bucket(engine, device):
    old = buckets_of(device, seed=2, step=1, engine=engine)
    new = buckets_of(device, seed=1, step=2, engine=engine)
    name = late_quantized(new)
    stale_value = next(r.value for b in old for r in b.records if r.name == name)
    # the buffer still holds the previous update's bytes, the checksum is the new one
    stale = replace_record(new, name, lambda r: WeightRecord(r.name, stale_value, r.hash))
    refused(engine, stale, "checksum mismatch")
    assert [b.nbytes for b in old] == [b.nbytes for b in new]
    refused(engine, [new[0], old[1], *new[2:]], "stale bucket")


def test_reordered_records_or_buckets(engine, device):
    buckets = buckets_of(device, engine=engine)
    a, b = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    values = {r.name: r.value for bucket in buckets for r in bucket.records}
    swapped = replace_record(
        replace_record(buckets, a, lambda r: WeightRecord(a, values[b], r.hash)),
        b,
        lambda r: WeightRecord(b, values[a], r.hash),
    )
    refused(engine, swapped, "checksum mismatch")
    refused(engine, [buckets[1], buckets[0], *buckets[2:]], "where bucket 0 was due")
