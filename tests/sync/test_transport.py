"""In-process sync into an Engine: byte equality, atomic refusal, logits follow the trainer."""

import dataclasses
import time

import pytest
import torch

from mxrl.engine import Engine
from mxrl.formats import QTensor
from mxrl.sync import InProcessTransport
from mxrl.weights import WeightRecord, export, export_weights
from tests.sync.helpers import PROMPT, engine_logits, hashes, tiny


def fresh_export_hashes(model, plan):
    return hashes(export_weights(model.named_parameters(), plan))


def test_engine_holds_the_trainers_fresh_export_byte_for_byte(trainer, preset):
    engine = Engine(tiny(seed=0), preset)
    assert hashes(engine.records()) != fresh_export_hashes(trainer, engine.plan)
    t0 = time.perf_counter()
    report = InProcessTransport(engine).send(export(trainer, engine.plan, bucket_bytes=40_000))
    wall = time.perf_counter() - t0
    assert report.version == engine.weights_version == 2
    assert hashes(engine.records()) == fresh_export_hashes(trainer, engine.plan)
    assert report.num_tensors == len(engine.plan)
    assert report.num_bytes == report.event.num_bytes == sum(r.nbytes for r in engine.records())
    # the event times the export from export() on, the report the send: both within the wall
    # time of the two (the export quantizes its first tensor before send starts)
    assert wall >= report.seconds > 0 and wall >= report.event.seconds > 0


def test_after_an_optimizer_step_a_sync_changes_the_engines_logits():
    trainer = tiny(seed=0)
    engine = Engine(trainer, "nvfp4-dequantized")
    sync = InProcessTransport(engine)
    before = engine_logits(engine)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    ids = torch.tensor([PROMPT + PROMPT[:2]])
    loss = torch.nn.functional.cross_entropy(
        trainer(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()
    )
    loss.backward()
    opt.step()
    assert torch.equal(engine_logits(engine), before)  # nothing moves until the sync
    report = sync.send(export(trainer, engine.plan, step=1))
    after = engine_logits(engine)
    assert not torch.equal(after, before)
    assert (after - before).abs().max() > 1e-4
    assert report.event.step == 1
    assert hashes(engine.records()) == fresh_export_hashes(trainer, engine.plan)


def refused(engine, update, match):
    version, held, logits = engine.weights_version, hashes(engine.records()), engine_logits(engine)
    with pytest.raises(ValueError, match=match):
        InProcessTransport(engine).send(update)
    assert engine.weights_version == version
    assert hashes(engine.records()) == held
    assert torch.equal(engine_logits(engine), logits)


def test_plan_hash_mismatch_raises_and_keeps_the_old_weights(trainer):
    engine = Engine(tiny(seed=0), "nvfp4-dequantized")
    other = Engine(tiny(seed=0), "mxfp8").plan
    refused(engine, export(trainer, other), "plan hash mismatch")


def tamper(buckets, index, how):
    """Replace record `index` (counted over all buckets) by a tampered copy."""
    out, seen = [], 0
    for b in buckets:
        records = list(b.records)
        if seen <= index < seen + len(records):
            records[index - seen] = how(records[index - seen])
        seen += len(b.records)
        out.append(dataclasses.replace(b, records=tuple(records)))
    return out


def wrong_hash(r: WeightRecord) -> WeightRecord:
    return WeightRecord(r.name, r.value, "0" * 64)


def flipped_byte(r: WeightRecord) -> WeightRecord:
    v = r.value
    assert isinstance(v, QTensor)
    qdata = v.qdata.clone()
    qdata.view(-1)[5] ^= 0x10
    return WeightRecord(r.name, dataclasses.replace(v, qdata=qdata), r.hash)


@pytest.mark.parametrize("how", [wrong_hash, flipped_byte])
def test_a_tampered_record_is_refused_and_nothing_is_applied(trainer, how):
    engine = Engine(tiny(seed=0), "nvfp4-dequantized")
    buckets = list(export(trainer, engine.plan, bucket_bytes=30_000))
    assert len(buckets) > 3
    names = [r.name for b in buckets for r in b.records]
    last_quantized = max(i for i, n in enumerate(names) if "experts" in n and ".2." in n)
    # a late record: every bucket before it would have been staged already
    refused(engine, tamper(buckets, last_quantized, how), "checksum mismatch")


def test_an_incomplete_or_reordered_update_is_refused(trainer):
    engine = Engine(tiny(seed=0), "mxfp8")
    buckets = list(export(trainer, engine.plan, bucket_bytes=30_000))
    refused(engine, buckets[:-1], "none was marked last")
    refused(engine, [buckets[0], *buckets[2:]], "bucket 2 arrived where bucket 1 was due")
    refused(engine, [*buckets, buckets[-1]], "after the last bucket")


def test_a_nan_master_weight_is_refused_before_anything_is_sent(trainer):
    engine = Engine(tiny(seed=0), "mxfp8")
    version, held = engine.weights_version, hashes(engine.records())
    with torch.no_grad():
        trainer.model.layers[1].self_attn.o_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight"):
        InProcessTransport(engine).send(export(trainer, engine.plan))
    assert engine.weights_version == version and hashes(engine.records()) == held
