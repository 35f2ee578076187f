"""The ranks of the sync test (spawned by test_distributed.py): rank 0 trains and sends, every
other rank runs an Engine and receives (two or three ranks: one or two engine ranks). Each writes what it saw to `rank{r}.json` in `out`. gloo: both on the
CPU; nccl: rank r on cuda:r, compared with exports made on the CPU.

Rank 1 counts the checksum work of its first receive (every call of `field_digests`, which every
checksum goes through). The last sync runs with a small meta on both ranks (`META_BYTES`), so
that some headers travel inline and the others as a broadcast of their own."""

import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mxrl.engine import Engine
from mxrl.recipe import resolve
from mxrl.sync import DistributedReceiver, DistributedSender, distributed
from mxrl.weights import digest, export, export_weights, stored_tensors
from tests.sync.helpers import hashes, tiny

PRESET = "nvfp4-dequantized"
BUCKET_BYTES = 48 * 1024
SMALL_META = 1536  # headers of 1.4-2.7 KB: some inline, some on their own


class CountDigests:
    """Wraps digest.field_digests: how often it ran, over how many fields."""

    def __init__(self) -> None:
        self.calls = self.fields = 0
        self.wrapped = digest.field_digests

    def __call__(self, fields, backend=None):
        self.calls += 1
        self.fields += len(fields)
        return self.wrapped(fields, backend)


def flip_first_byte_of_bucket_1(index: int, payload: torch.Tensor) -> None:
    if index == 1:
        payload[0] ^= 0x01  # the first byte of the bucket's first tensor: data, not padding


class FailsMidway:
    """An update whose export breaks after its first bucket."""

    step = 3

    def __init__(self, update) -> None:
        self.update = update

    def __iter__(self):
        buckets = iter(self.update)
        yield next(buckets)
        raise RuntimeError("export failed after bucket 0")


def run(rank: int, port: int, out: str, backend: str = "gloo", world_size: int = 2) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    trained, trained_more = tiny(seed=1).to(device), tiny(seed=2).to(device)
    shapes = {n: p.shape for n, p in trained.named_parameters()}
    seen: dict = {}
    if rank == 0:
        plan = resolve(PRESET, shapes)
        sender = DistributedSender(src=0)
        update = export(trained, plan, bucket_bytes=BUCKET_BYTES, step=1)
        report = sender.send(update)
        seen["good"] = {"version": report.version, "num_bytes": report.num_bytes}
        seen["event"] = update.event.to_dict()
        for case, s, p in [
            ("corrupted", DistributedSender(src=0, tamper=flip_first_byte_of_bucket_1), plan),
            ("mismatch", sender, resolve("mxfp8", shapes)),
        ]:
            try:
                s.send(export(trained_more, p, bucket_bytes=BUCKET_BYTES, step=2))
                seen[case] = "accepted"
            except ValueError as e:
                seen[case] = str(e)
        try:
            sender.send(FailsMidway(export(trained_more, plan, bucket_bytes=BUCKET_BYTES)))
            seen["aborted"] = "sent"
        except RuntimeError as e:
            seen["aborted"] = str(e)
        distributed.META_BYTES = SMALL_META
        update = export(trained_more, plan, bucket_bytes=BUCKET_BYTES, step=4)
        seen["small_meta"] = {"version": sender.send(update).version}
    else:
        engine = Engine(tiny(seed=0), PRESET, device=device)
        receiver = DistributedReceiver(engine, src=0)
        count = digest.field_digests = CountDigests()
        try:
            report = receiver.receive()
        finally:
            digest.field_digests = count.wrapped
        local = hashes(export_weights(tiny(seed=1).named_parameters(), engine.plan))  # on CPU
        held = hashes(engine.records())
        seen["good"] = {
            "version": report.version,
            "num_bytes": report.num_bytes,
            "equal_to_local_export": held == local,
            "event": report.event.to_dict(),
        }
        seen["good"]["device"] = str(next(iter(engine.weights.values())).device)
        seen["good"]["digest_calls"] = count.calls
        seen["good"]["digested_fields"] = count.fields
        seen["good"]["fields"] = sum(len(stored_tensors(v)) for v in engine.weights.values())
        seen["good"]["num_buckets"] = sum(
            1 for _ in export(tiny(seed=1), engine.plan, bucket_bytes=BUCKET_BYTES)
        )
        for case in ("corrupted", "mismatch", "aborted"):
            try:
                receiver.receive()
                seen[case] = "accepted"
            except ValueError as e:
                seen[case] = str(e)
            seen[f"{case}_kept"] = {
                "version": engine.weights_version,
                "equal_to_previous": hashes(engine.records()) == held,
            }
        distributed.META_BYTES = SMALL_META
        report = receiver.receive()
        local = hashes(export_weights(tiny(seed=2).named_parameters(), engine.plan))
        seen["small_meta"] = {
            "version": report.version,
            "equal_to_local_export": hashes(engine.records()) == local,
        }
    dist.barrier()
    dist.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(seen))
