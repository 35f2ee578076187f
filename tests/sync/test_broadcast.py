"""torch.distributed sync: the wire format, and a real two-process gloo run (trainer -> engine)."""

import dataclasses
import json
import socket
import time
import warnings

import pytest
import torch
import torch.multiprocessing as mp

from mxrl.recipe import resolve
from mxrl.sync import pack_bucket, unpack_bucket
from mxrl.weights import export
from tests.sync import dist_worker
from tests.sync.attacks import ATTACKS, names_the_tensor
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
        assert {r.name: checksum(r.name, r.value) for r in back.records} == hashes(bucket.records)


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


def two_ranks(out, backend: str, world_size: int = 2, *, attempts: int = 2):
    """Run dist_worker on `world_size` spawned processes (one sender, the rest engine ranks);
    the ranks' observations.

    A run in which a rank is killed by a signal is started once more (`attempts`): CI once saw
    a rank of the three-rank gloo run abort in native code ("terminate called without an active
    exception", SIGABRT) on a loaded 2-core machine, which 60 runs here did not reproduce. Each
    rank dumps its Python stacks on such a signal (faulthandler, in dist_worker), so the first
    run's stacks stay in the captured output; a rank failing by a Python exception, a timeout or
    a second signal fails the test."""
    for attempt in range(1, attempts + 1):
        ctx = mp.start_processes(
            dist_worker.run,
            args=(_free_port(), str(out), backend, world_size),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + 120
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.terminate()
                    pytest.fail(f"the {backend} sync test timed out (a rank is stuck)")
        except mp.ProcessExitedException as e:
            if e.signal_name is None or attempt == attempts:
                raise
            warnings.warn(f"{backend} sync run {attempt}: {e}; running it again", stacklevel=1)
            continue
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    return two_ranks(tmp_path_factory.mktemp("gloo"), "gloo")


ACCEPTED = {"good": 2, "scheduled": 3, "small_meta": 4, "small_meta_scheduled": 5}  # versions
REFUSED = [case for case, seed in dist_worker.CASES if seed is None]
MODES = {
    "good": "per-bucket",
    "scheduled": "scheduled",
    "corrupted_scheduled": "scheduled",
    "corrupted": "per-bucket",
    "corrupted_on_the_last_rank": "scheduled",
    "malformed_trailer": "scheduled",
    "mismatch": "per-bucket",
    "aborted_scheduled": "scheduled",
    "aborted": "per-bucket",
    "relaid": "scheduled",
    "nan_master": "per-bucket",  # after "relaid", the sender learns the layout again
    "small_meta": "per-bucket",
    "small_meta_scheduled": "scheduled",
}


def check_refused_cases(trainer, engine, ranks="[1]", rank=1):
    """Every refused case, seen by the sender and engine rank `rank` (of engine ranks `ranks`):
    the engine kept the weights of the last accepted update (version 3), and each end says why.
    Where only the last engine rank received corrupted bytes, every engine rank refuses (all or
    nothing) and the sender names that rank."""
    last = ranks.strip("[]").split(", ")[-1]
    if str(rank) == last:
        assert "checksum mismatch" in engine["corrupted_on_the_last_rank"]["refused"]
    else:
        assert (
            f"engine rank(s) [{last}] refused this update, so this rank does not load"
            in (engine["corrupted_on_the_last_rank"]["refused"])
        )
    assert f"engine rank(s) [{last}] refused" in trainer["corrupted_on_the_last_rank"]["refused"]
    for case in REFUSED:
        assert engine[case]["version"] == 3 and engine[case]["equal_to_previous"], case
    for case in ("corrupted", "corrupted_scheduled"):
        assert "checksum mismatch" in engine[case]["refused"], case
        assert f"engine rank(s) {ranks} refused" in trainer[case]["refused"], case
    assert "malformed update trailer (KeyError('step'))" in engine["malformed_trailer"]["refused"]
    assert f"engine rank(s) {ranks} refused" in trainer["malformed_trailer"]["refused"]
    assert "plan hash mismatch" in engine["mismatch"]["refused"]
    assert f"engine rank(s) {ranks} refused" in trainer["mismatch"]["refused"]
    for case in ("aborted", "aborted_scheduled"):
        assert "export failed after bucket 0" in trainer[case]["refused"], case
        assert "aborted" in engine[case]["refused"], case
    assert "bucket 0 is laid out differently" in trainer["relaid"]["refused"]
    assert "refusing to export: 1 master weight(s) hold NaN/Inf" in trainer["nan_master"]["refused"]
    assert "aborted" in engine["nan_master"]["refused"]
    assert "aborted" in engine["relaid"]["refused"]


def test_engine_rank_holds_the_bytes_of_a_local_export(gloo_run):
    trainer, engine = gloo_run
    for case, version in ACCEPTED.items():
        assert engine[case]["equal_to_local_export"], case
        assert trainer[case]["version"] == engine[case]["version"] == version, case
        assert trainer[case]["num_bytes"] == engine[case]["num_bytes"], case
    assert engine["good"]["event"] == trainer["good"]["event"]  # the event travels with the data
    assert set(trainer["good"]["event"]["sqnr_db"]) == {"layer.0", "layer.1", "layer.2"}


def test_the_first_update_goes_bucket_by_bucket_and_the_next_ones_scheduled(gloo_run):
    """Scheduled once both ends hold the layout of an update under the same plan and bucket
    size; bucket by bucket for a new sender, another plan, an update that does not say its
    plan, and after the sender found its export laid out differently."""
    trainer, engine = gloo_run
    assert {case: trainer[case]["mode"] for case in MODES} == MODES
    assert {case: engine[case]["mode"] for case in MODES} == MODES


def test_the_engine_rank_checksums_each_record_once_bucket_by_bucket(gloo_run):
    _, engine = gloo_run
    for case in dist_worker.COUNTED:  # one per mode
        got = engine[case]
        assert got["num_buckets"] > 3
        # every field of every record digested exactly once on the receiving rank (not again
        # in load_weights), in one batch per bucket as it arrived (not all after the last one)
        assert got["digested_fields"] == got["fields"] > 0, case
        assert got["digest_calls"] == got["num_buckets"], case


def test_headers_and_trailers_that_do_not_fit_the_meta_travel_on_their_own(gloo_run):
    trainer, engine = gloo_run
    for case in ("small_meta", "small_meta_scheduled"):
        assert engine[case]["equal_to_local_export"], case
        assert trainer[case]["version"] == engine[case]["version"], case


def test_refused_updates_keep_the_weights_and_say_why_on_both_ends(gloo_run):
    """A payload corrupted in transit, a plan hash mismatch, an export failing mid-way and an
    export whose layout is not the agreed one: refused in both modes, the weights kept."""
    check_refused_cases(*gloo_run)


def test_forged_updates_are_refused_by_the_receiver_with_the_engine_unchanged(gloo_run):
    """tests/sync/attacks.py over the wire: records swapped with their checksums, fields that
    are not what the plan stores, unusable global scales (bucket by bucket, and scheduled where
    the layout is unchanged), a stale and a replayed step: each refused on the engine rank,
    naming the tensor (or the step), with its bytes, hashes, version and step unchanged, and on
    the sender; the honest update of the refused ones' step then loads."""
    trainer, engine = gloo_run
    named = {a[0]: a[2] for a in ATTACKS}
    for case, step, accepted in dist_worker.MIXED_CASES:
        got, sent = engine[case], trainer[case]
        if accepted:
            assert got.get("accepted") and got["step"] == step, (case, got)
            assert "refused" not in sent, (case, sent)
            continue
        assert got["unchanged"] and "accepted" not in got, (case, got)
        assert "engine rank(s) [1] refused" in sent["refused"], (case, sent)
        kind, _, attack = case.partition(":")
        if attack:
            assert names_the_tensor(got["refused"], named[attack]), (case, got["refused"])
        want = "scheduled" if kind in ("scheduled", "stale", "replayed") else "per-bucket"
        assert got["mode"] == sent["mode"] == want, (case, got["mode"], sent["mode"])
    assert "update of step 1 refused" in engine["stale"]["refused"]
    assert "step 2 refused" in engine["replayed"]["refused"]
    assert "replayed" in engine["replayed"]["refused"]
    for attack in dist_worker.SAME_LAYOUT:
        message = engine[f"scheduled:{attack}"]["refused"]
        assert message == engine[f"attack:{attack}"]["refused"], attack  # the same check
    assert engine["mixed_after"]["version"] == 4  # built, two updates, then the last


def test_two_engine_ranks_receive_broadcasts_and_refuse_together(tmp_path):
    """Three ranks, one sender and two engine ranks on one broadcast: both hold the export's
    bytes in both modes, each checksums every field once, and every refused update is refused
    on both (the sender names both ranks) with their weights kept."""
    trainer, *engines = two_ranks(tmp_path, "gloo", world_size=3)
    for rank, engine in enumerate(engines, start=1):
        for case, version in ACCEPTED.items():
            assert engine[case]["equal_to_local_export"], case
            assert trainer[case]["version"] == engine[case]["version"] == version, case
        assert {case: engine[case]["mode"] for case in MODES} == MODES
        for case in dist_worker.COUNTED:
            assert engine[case]["digested_fields"] == engine[case]["fields"] > 0
        check_refused_cases(trainer, engine, ranks="[1, 2]", rank=rank)


@pytest.mark.gpu
def test_nccl_sync_between_two_gpus_gives_the_cpu_export_bytes(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    trainer, engine = two_ranks(tmp_path, "nccl")
    assert engine["good"]["device"] == "cuda:1"
    for case, version in ACCEPTED.items():  # exported on cuda:0, compared with the CPU
        assert engine[case]["equal_to_local_export"], case
        assert trainer[case]["version"] == engine[case]["version"] == version, case
    assert {case: engine[case]["mode"] for case in MODES} == MODES
    for case in dist_worker.COUNTED:
        assert engine[case]["digested_fields"] == engine[case]["fields"], case
        assert engine[case]["digest_calls"] == engine[case]["num_buckets"], case
    check_refused_cases(trainer, engine)
