"""torch.distributed sync: the wire format, and a real two-process gloo run (trainer -> engine)."""

import dataclasses
import json
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from mxrl.recipe import resolve
from mxrl.sync import pack_bucket, unpack_bucket
from mxrl.weights import export
from tests.sync import dist_worker
from tests.sync.helpers import hashes, tiny


@pytest.mark.parametrize("preset", ["bf16", "mxfp8", "nvfp4-dequantized"])
def test_pack_unpack_round_trips_every_record_bit_for_bit(preset):
    model = tiny()
    plan = resolve(preset, {n: p.shape for n, p in model.named_parameters()})
    for bucket in export(model, plan, bucket_bytes=100_000):
        header, payload = pack_bucket(bucket)
        assert payload.dtype == torch.uint8 and payload.dim() == 1
        back = unpack_bucket(header, payload)
        assert dataclasses.replace(back, records=()) == dataclasses.replace(bucket, records=())
        from mxrl.weights import checksum

        assert hashes(back.records) == hashes(bucket.records)
        assert {r.name: checksum(r.value) for r in back.records} == hashes(bucket.records)


def test_unpack_refuses_a_header_that_does_not_fit_the_payload():
    model = tiny()
    plan = resolve("mxfp8", {n: p.shape for n, p in model.named_parameters()})
    bucket = next(iter(export(model, plan, bucket_bytes=30_000)))
    header, payload = pack_bucket(bucket)
    with pytest.raises(ValueError, match="payload bytes"):
        unpack_bucket(header, payload[:-16])
    with pytest.raises(ValueError, match="malformed"):
        unpack_bucket(header[:-5], payload)
    bad = json.loads(header)
    bad["records"][0]["fields"][0]["dtype"] = "complex64"
    with pytest.raises(ValueError, match="complex64"):
        unpack_bucket(json.dumps(bad).encode(), payload)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(out, backend: str, world_size: int = 2):
    """Run dist_worker on `world_size` spawned processes (one sender, the rest engine ranks);
    the ranks' observations."""
    ctx = mp.start_processes(
        dist_worker.run,
        args=(_free_port(), str(out), backend, world_size),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"the {backend} sync test timed out (a rank is stuck in a collective)")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    return two_ranks(tmp_path_factory.mktemp("gloo"), "gloo")


def test_engine_rank_holds_the_bytes_of_a_local_export(gloo_run):
    trainer, engine = gloo_run
    assert engine["good"]["equal_to_local_export"]
    assert trainer["good"]["version"] == engine["good"]["version"] == 2
    assert trainer["good"]["num_bytes"] == engine["good"]["num_bytes"]
    assert engine["good"]["event"] == trainer["event"]  # the event travels with the last bucket
    assert set(trainer["event"]["sqnr_db"]) == {"layer.0", "layer.1", "layer.2"}


def test_the_engine_rank_checksums_each_record_once_bucket_by_bucket(gloo_run):
    _, engine = gloo_run
    good = engine["good"]
    assert good["num_buckets"] > 3
    # every field of every record digested exactly once on the receiving rank (not again in
    # load_weights), in one batch per bucket as it arrived (not all after the last one)
    assert good["digested_fields"] == good["fields"] > 0
    assert good["digest_calls"] == good["num_buckets"]


def test_headers_that_do_not_fit_the_meta_travel_on_their_own(gloo_run):
    trainer, engine = gloo_run
    assert trainer["small_meta"]["version"] == engine["small_meta"]["version"] == 3
    assert engine["small_meta"]["equal_to_local_export"]


def test_a_payload_corrupted_in_transit_is_refused_on_both_ends(gloo_run):
    trainer, engine = gloo_run
    assert "checksum mismatch" in engine["corrupted"]
    assert "engine rank(s) [1] refused" in trainer["corrupted"]
    assert engine["corrupted_kept"] == {"version": 2, "equal_to_previous": True}


def test_a_plan_hash_mismatch_is_refused_on_both_ends(gloo_run):
    trainer, engine = gloo_run
    assert "plan hash mismatch" in engine["mismatch"]
    assert "engine rank(s) [1] refused" in trainer["mismatch"]
    assert engine["mismatch_kept"] == {"version": 2, "equal_to_previous": True}


def test_an_export_failing_midway_aborts_every_rank(gloo_run):
    trainer, engine = gloo_run
    assert "export failed after bucket 0" in trainer["aborted"]
    assert "aborted" in engine["aborted"]
    assert engine["aborted_kept"] == {"version": 2, "equal_to_previous": True}


def test_two_engine_ranks_receive_broadcasts_and_refuse_together(tmp_path):
    """Three ranks, one sender and two engine ranks on one broadcast: both hold the export's
    bytes, each checksums every field once, and a corrupted payload is refused on both (the
    sender names both ranks) with their weights kept."""
    trainer, *engines = two_ranks(tmp_path, "gloo", world_size=3)
    assert trainer["good"]["version"] == 2
    for engine in engines:
        assert engine["good"]["equal_to_local_export"] and engine["good"]["version"] == 2
        assert engine["good"]["digested_fields"] == engine["good"]["fields"] > 0
        assert "checksum mismatch" in engine["corrupted"]
        assert engine["corrupted_kept"] == {"version": 2, "equal_to_previous": True}
        assert engine["small_meta"]["equal_to_local_export"]
    assert "engine rank(s) [1, 2] refused" in trainer["corrupted"]


@pytest.mark.gpu
def test_nccl_sync_between_two_gpus_gives_the_cpu_export_bytes(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    trainer, engine = two_ranks(tmp_path, "nccl")
    assert engine["good"]["device"] == "cuda:1"
    assert engine["good"]["equal_to_local_export"]  # exported on cuda:0, compared with the CPU
    assert trainer["good"]["version"] == engine["good"]["version"] == 2
    for case in ("corrupted", "mismatch", "aborted"):
        assert engine[f"{case}_kept"] == {"version": 2, "equal_to_previous": True}, case
    assert "checksum mismatch" in engine["corrupted"]
    assert "plan hash mismatch" in engine["mismatch"]
    assert engine["good"]["digested_fields"] == engine["good"]["fields"]
    assert engine["good"]["digest_calls"] == engine["good"]["num_buckets"]
    assert engine["small_meta"]["equal_to_local_export"]
