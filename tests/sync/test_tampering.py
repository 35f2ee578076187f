"""Tampered updates are refused and the engine keeps serving its previous weights, untouched
(same bytes, same hashes, version and step, same buffers, same logits): a flipped byte in any
field of any format, a truncated bucket or payload, a wrong plan, a stale record or bucket,
reordered records or buckets, records swapped with their checksums, fields that are not what
the plan stores (tests/sync/attacks.py, checksums recomputed), unusable NVFP4 global scales, a
stale or replayed step. On the CPU, and the same on CUDA (records exported and checksummed on
the GPU)."""

import dataclasses
import re

import pytest
import torch

from mxrl.engine import Engine
from mxrl.formats import QTensor
from mxrl.recipe import resolve
from mxrl.sync import InProcessTransport, pack_bucket, unpack_bucket
from mxrl.weights import WeightRecord, export, stored_tensors
from tests.engine.test_load_in_place import forward_bytes, forward_tensors
from tests.sync.attacks import ATTACK_IDS, ATTACKS, engine_state
from tests.sync.helpers import MIXED, engine_logits, hashes, tiny

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


@pytest.fixture
def mixed(device):
    """An engine holding every stored layout (helpers.MIXED)."""
    return Engine(tiny(seed=0).to(device), MIXED, device=device)


def refused(engine, buckets, match):
    held = hashes(engine.records())
    state, logits, storage = engine_state(engine), engine_logits(engine), forward_tensors(engine)
    with pytest.raises(ValueError, match=match):
        InProcessTransport(engine).send(buckets)
    assert engine_state(engine) == state  # bytes, verified hashes, version and step
    assert hashes(engine.records()) == held
    assert forward_tensors(engine) == storage
    assert torch.equal(engine_logits(engine), logits)


def refused_unchanged(engine, buckets, match):
    """Refused, and every byte the forward reads, every buffer, the hashes, version and step
    as they were (cheaper than `refused`'s logits, and stricter: derived operands included)."""
    state, storage, held = engine_state(engine), forward_tensors(engine), forward_bytes(engine)
    with pytest.raises(ValueError, match=match):
        InProcessTransport(engine).send(buckets)
    assert engine_state(engine) == state  # bytes, verified hashes, version and step
    assert forward_tensors(engine) == storage
    assert forward_bytes(engine) == held


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


@pytest.fixture(scope="module", params=DEVICES)
def held(request):
    """(an engine holding every stored layout, the honest buckets of step 1) shared by the
    attack tests of a device: each refusal must leave the engine as it was, which each test
    asserts."""
    engine = Engine(tiny(seed=0).to(request.param), MIXED, device=request.param)
    return engine, buckets_of(request.param, engine=engine)


@pytest.mark.parametrize("attack", ATTACKS, ids=ATTACK_IDS)
def test_a_record_that_is_not_what_the_plan_says_is_refused(held, attack):
    """Each forged update (tests/sync/attacks.py) is refused naming the tensor, what the plan
    says and what came, the engine unchanged."""
    engine, honest = held
    _, forge, name, match = attack
    refused_unchanged(engine, forge(honest), re.escape(name) + ".*" + match)


def test_a_refused_update_leaves_its_step_to_the_honest_one(mixed, device):
    """A refusal does not consume the update's step: the honest export of that step loads."""
    honest = buckets_of(device, engine=mixed)
    _, forge, name, match = ATTACKS[ATTACK_IDS.index("nan_global_scale")]
    refused_unchanged(mixed, forge(honest), re.escape(name) + ".*" + match)
    InProcessTransport(mixed).send(honest)
    assert mixed.weights_step == 1
    assert hashes(mixed.records()) == hashes(r for b in honest for r in b.records)


FIELDS = {  # one tensor of each stored layout of the MIXED plan, and its fields
    "model.layers.0.self_attn.q_proj.weight": ("qdata", "scale"),  # mxfp8
    "model.layers.0.self_attn.o_proj.weight": ("qdata", "scale"),  # fp8_block 32x32
    "model.layers.0.mlp.shared_expert.down_proj.weight": ("qdata", "scale", "global_scale"),  # []
    "model.layers.0.mlp.experts.gate_up_proj": ("qdata", "scale", "global_scale"),  # per expert
    "model.layers.2.mlp.experts.gate_up_proj": ("qdata", "scale", "global_scale"),  # per row
    "model.layers.0.mlp.gate.weight": ("",),  # a plain bf16 tensor
}


@pytest.mark.parametrize(
    ("name", "field"), [(n, f) for n, fields in FIELDS.items() for f in fields]
)
def test_a_flipped_byte_in_any_field_of_any_format_is_refused(held, name, field):
    """The last byte of every field (the 0-d per-tensor global scale included), carrying the
    record's honest checksum: refused as a checksum mismatch naming the tensor."""
    engine, buckets = held

    def flip(r):
        fields = {k: t.clone() for k, t in stored_tensors(r.value).items()}
        fields[field].reshape(-1).view(torch.uint8)[-1] ^= 0x01
        if not isinstance(r.value, QTensor):
            return WeightRecord(r.name, fields[""], r.hash)
        return WeightRecord(r.name, dataclasses.replace(r.value, **fields), r.hash)

    refused_unchanged(
        engine, replace_record(buckets, name, flip), re.escape(name) + ": checksum mismatch"
    )


def test_a_stale_or_replayed_step_is_refused(mixed, device):
    """An older step's export sent after a newer one, and the same step sent twice, are
    refused; a later step loads."""
    older, newer = buckets_of(device, seed=2, step=1, engine=mixed), buckets_of(device, step=2,
                                                                                engine=mixed)  # fmt: skip
    InProcessTransport(mixed).send(newer)
    assert mixed.weights_step == 2
    refused_unchanged(mixed, older, "update of step 1 refused: the engine holds the weights of "
                      "step 2.*stale")  # fmt: skip
    replay = buckets_of(device, seed=2, step=2, engine=mixed)
    refused_unchanged(mixed, replay, "step 2 refused.*replayed")
    InProcessTransport(mixed).send(buckets_of(device, seed=2, step=3, engine=mixed))
    assert mixed.weights_step == 3


def test_a_resume_sends_its_checkpoint_step_to_a_fresh_engine(mixed, device):
    """An engine built for a resumed run has loaded no update yet: the checkpoint's step (here
    7) is its first, any later one follows, the same one again is a replay."""
    assert mixed.weights_step is None
    InProcessTransport(mixed).send(buckets_of(device, step=7, engine=mixed))
    refused_unchanged(mixed, buckets_of(device, seed=2, step=7, engine=mixed), "replayed")
    InProcessTransport(mixed).send(buckets_of(device, seed=2, step=8, engine=mixed))
    assert (mixed.weights_step, mixed.weights_version) == (8, 3)
