"""Weight sync over torch.distributed: one trainer rank broadcasts, engine ranks verify and load.

    # trainer rank (src)                          # every engine rank
    sender = DistributedSender(group, src=0)      receiver = DistributedReceiver(engine, group, src=0)
    sender.send(export(model, plan, step=s))      receiver.receive()

Every rank of `group` takes part: `src` sends, all others receive (gloo on CPU tensors, NCCL on
the current CUDA device). The sender quantizes bucket k+1 while bucket k is on the wire: on CUDA
the export and the packing run on a side stream and the payload broadcast is asynchronous, with
at most two payloads alive (the one in transfer, the one being built); on gloo / CPU the steps
run one after the other. Per bucket, two broadcasts from `src` (wire version 3):

1. meta, uint8[META_BYTES = 64 KiB], fixed size, so a receiver always knows how much follows,
   even when it cannot use what arrives: int64[4] (little-endian) wire version, flags (1 = last
   bucket, 2 = the sender aborted), header length, payload length; the sha256 of the header (32
   bytes); then the header itself when it fits the remaining META_BYTES - 64 bytes (zero-padded).
   A longer header follows as a broadcast of its own, uint8[header length].
2. payload, one flat uint8 bucket: every field's bytes, each at a 16-byte-aligned offset.

The header is the JSON of the bucket (index, last, num_buckets, plan hash, step, the
QuantizationEvent on the last bucket) and of each record: name, checksum, and its fields
(QTensor qdata / scale / global_scale, or one plain tensor) as dtype, shape, offset and byte
count in the payload. (Wire 2 sent the meta as int64[8] and the header always on its own.)

The receive pipeline: one host round trip per bucket, reading its meta (with the header inline).
The payload's receive is then queued without waiting for it, the bucket's records are rebuilt as
views of the payload (`QTensor.from_state_dict`, on the rank's device), and their checksums are
queued behind the payload (CUDA: on a side stream, their 64 bytes per field copied to pinned
host memory behind an event; gloo / CPU: computed at once), before the next bucket's meta is
received: bucket k is verified while bucket k+1 is on the wire. The meta of bucket k+1 travels
behind payload k (one communicator, one stream), so that host read is also where payload k has
landed. After the last bucket the receiver reads the digests (only the last bucket's can still
be running), compares every record's checksum with the one it carries, and hands the records to
ONE `Engine.load_weights` call (`transport.apply_update`) as `VerifiedRecord`s, which it does not
checksum again (once on send, once on receive), before it copies anything into the engine's
buffers. A receiver keeps receiving to the last bucket even after an error, so the collectives
stay in step; then all ranks all-gather (failed, weights_version), and a refusal on any engine
rank raises on the sender too, naming the ranks. Nothing is half-applied: a refused update
leaves each engine rank on its previous weights. Memory: every payload of the update (all or
nothing), plus the checksums' workspace of the buckets being verified (1/32 of their bytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mxrl.engine import Engine
from mxrl.formats import QTensor
from mxrl.sync.transport import SyncReport, apply_update
from mxrl.weights import (
    Bucket,
    Export,
    PendingChecksums,
    QuantizationEvent,
    WeightRecord,
    verified_records,
)

logger = logging.getLogger(__name__)

# 3: the header inline in a fixed 64 KiB meta; 2: records carry mxrl.weights checksums (meta
# int64[8], header on its own); 1: sha256 content hashes
WIRE_VERSION = 3
FLAG_LAST = 1
FLAG_ABORT = 2
META_BYTES = 64 * 1024  # the meta broadcast: _HEAD_BYTES, then the header if it fits
_HEAD = struct.Struct("<4q32s")  # wire version, flags, header length, payload length, sha256
_HEAD_BYTES = _HEAD.size  # 64
_ALIGN = 16
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.uint8,
        torch.int8,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e8m0fnu,
    )
}

Tamper = Callable[[int, torch.Tensor], None]


# --- wire format -------------------------------------------------------------------------------
def pack_bucket(bucket: Bucket, device: torch.device | str = "cpu") -> tuple[bytes, torch.Tensor]:
    """(header JSON bytes, flat uint8 payload on `device`) for one bucket."""
    fields: list[tuple[torch.Tensor, int]] = []
    records: list[dict[str, Any]] = []
    offset = 0
    for record in bucket.records:
        value = record.value
        tensors = value.tensors() if isinstance(value, QTensor) else {"": value}
        described = []
        for key, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            described.append(
                {
                    "key": key,
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "offset": offset,
                    "nbytes": nbytes,
                }
            )
            fields.append((t, offset))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        records.append(
            {
                "name": record.name,
                "hash": record.hash,
                "qtensor": isinstance(value, QTensor),
                "fields": described,
            }
        )
    payload = torch.zeros(offset, dtype=torch.uint8, device=device)
    for t, off in fields:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        payload[off : off + flat.numel()].copy_(flat)
    header = {
        "wire": WIRE_VERSION,
        "index": bucket.index,
        "last": bucket.last,
        "num_buckets": bucket.num_buckets,
        "plan_hash": bucket.plan_hash,
        "step": bucket.step,
        "event": bucket.event.to_dict() if bucket.event is not None else None,
        "payload_bytes": offset,
        "records": records,
    }
    return json.dumps(header, separators=(",", ":")).encode(), payload


def unpack_bucket(header: bytes, payload: torch.Tensor) -> Bucket:
    """Rebuild a bucket from `pack_bucket`'s output; the tensors are views of `payload`.
    Raises ValueError for a header that does not describe this payload."""
    try:
        h = json.loads(header.decode())
        if h["wire"] != WIRE_VERSION:
            raise ValueError(f"wire version {h['wire']!r}, this mxrl speaks {WIRE_VERSION}")
        if h["payload_bytes"] != payload.numel():
            raise ValueError(
                f"header says {h['payload_bytes']} payload bytes, got {payload.numel()}"
            )
        records = tuple(_record(r, payload) for r in h["records"])
        event = QuantizationEvent.from_dict(h["event"]) if h["event"] is not None else None
        return Bucket(
            index=int(h["index"]),
            plan_hash=str(h["plan_hash"]),
            records=records,
            last=bool(h["last"]),
            num_buckets=h["num_buckets"],
            step=int(h["step"]),
            event=event,
        )
    except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed bucket header ({e!r}); the update is refused") from None


def _record(r: dict[str, Any], payload: torch.Tensor) -> WeightRecord:
    name = r["name"]
    tensors = {}
    for f in r["fields"]:
        dtype = _DTYPES.get(f["dtype"])
        if dtype is None:
            raise ValueError(f"{name}: dtype {f['dtype']!r} is not one a weight record uses")
        shape = tuple(int(d) for d in f["shape"])
        nbytes, off = int(f["nbytes"]), int(f["offset"])
        if (
            nbytes != math.prod(shape) * dtype.itemsize
            or off % _ALIGN
            or off + nbytes > len(payload)
        ):
            raise ValueError(f"{name}.{f['key']}: field does not fit the payload")
        tensors[f"{name}.{f['key']}" if f["key"] else name] = (
            payload[off : off + nbytes].view(dtype).reshape(shape)
        )
    value = QTensor.from_state_dict(tensors, name) if r["qtensor"] else tensors[name]
    return WeightRecord(name, value, str(r["hash"]))


def _meta(flags: int, header: bytes, payload_len: int, device: torch.device) -> torch.Tensor:
    """The meta of one bucket (module docstring), uint8[META_BYTES] on `device`."""
    meta = bytearray(META_BYTES)
    digest = hashlib.sha256(header).digest()
    _HEAD.pack_into(meta, 0, WIRE_VERSION, flags, len(header), payload_len, digest)
    if _inline(len(header)):
        meta[_HEAD_BYTES : _HEAD_BYTES + len(header)] = header
    return torch.frombuffer(meta, dtype=torch.uint8).to(device)


def _inline(header_len: int) -> bool:
    """Whether a header of this length travels inside the meta."""
    return header_len <= META_BYTES - _HEAD_BYTES


def _comm_device(group: dist.ProcessGroup | None, device: torch.device | str | None):
    if device is not None:
        return torch.device(device)
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_status(
    failed: int, version: int, group: dist.ProcessGroup | None, device: torch.device
) -> list[tuple[int, int, int]]:
    """Every rank's (global rank, failed, weights_version) after an update (the sender's is
    (src, 0, 0)): one all-gather, so that all ranks agree on the outcome."""
    mine = torch.tensor([failed, version], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [
        (dist.get_global_rank(group, i) if group is not None else i, int(t[0]), int(t[1]))
        for i, t in enumerate(everyone)
    ]


# --- the two ends ------------------------------------------------------------------------------
class DistributedSender:
    """The trainer end: broadcasts each bucket of an export from rank `src` (a global rank) to
    every other rank of `group` (None: the default group).

    tamper: tests only; called as tamper(bucket_index, payload) before the payload is broadcast,
    to corrupt bytes in transit on purpose.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        src: int = 0,
        *,
        device: torch.device | str | None = None,
        tamper: Tamper | None = None,
    ) -> None:
        if dist.get_rank() != src:
            raise ValueError(
                f"DistributedSender runs on rank src={src}, this is rank {dist.get_rank()}"
            )
        self.group, self.src, self.tamper = group, src, tamper
        self.device = _comm_device(group, device)

    def _broadcast(self, t: torch.Tensor, *, async_op: bool = False):
        return dist.broadcast(t, src=self.src, group=self.group, async_op=async_op)

    def send(self, update: Export) -> SyncReport:
        """Broadcast one export; returns once every engine rank has verified and loaded it.
        Raises ValueError when any engine rank refused it (they all keep their weights)."""
        t0 = time.perf_counter()
        num_tensors = num_bytes = 0
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if cuda else None
        inflight: deque = deque()  # (work, payload) of the payloads on the wire
        buckets = iter(update)
        while True:
            try:
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    bucket = next(buckets, None)  # quantized while the last payload transfers
                    if bucket is not None:
                        header, payload = pack_bucket(bucket, self.device)
            except Exception:
                # The export failed mid-way: tell the receivers, so that no rank waits forever.
                self._finish(inflight)
                self._broadcast(_meta(FLAG_ABORT, b"", 0, self.device))
                raise
            if bucket is None:
                break
            if side is not None:  # the broadcasts (current stream) follow the side stream
                current = torch.cuda.current_stream(self.device)
                current.wait_stream(side)
                payload.record_stream(current)
            if self.tamper is not None:
                self.tamper(bucket.index, payload)
            flags = FLAG_LAST if bucket.last else 0
            self._broadcast(_meta(flags, header, payload.numel(), self.device))
            if not _inline(len(header)):
                self._broadcast(
                    torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device)
                )
            if payload.numel():
                inflight.append((self._broadcast(payload, async_op=True), payload))
            self._finish(inflight, keep=1)  # bounded memory: one in transfer, one being built
            num_tensors += bucket.num_tensors
            num_bytes += bucket.nbytes
        self._finish(inflight)
        engines = [s for s in _gather_status(0, 0, self.group, self.device) if s[0] != self.src]
        refused = [rank for rank, failed, _ in engines if failed]
        if refused:
            raise ValueError(
                f"engine rank(s) {refused} refused weight update step {update.step} (their logs "
                "say why); every engine rank keeps its previous weights"
            )
        versions = sorted({version for _, _, version in engines})
        if len(versions) > 1:
            logger.warning("engine ranks disagree on weights_version: %s", versions)
        elapsed = time.perf_counter() - t0
        return SyncReport(versions[-1], num_tensors, num_bytes, elapsed, update.event)

    def _finish(self, inflight: deque, keep: int = 0) -> None:
        """Wait until all but `keep` of the payloads on the wire have left, the host too (that
        bounds how many are alive)."""
        if len(inflight) <= keep:
            return
        while len(inflight) > keep:
            work, _ = inflight.popleft()
            work.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


class DistributedReceiver:
    """The engine end: receives one update from rank `src` per `receive()` call and loads it
    into `engine` (see the module docstring for what is checked)."""

    def __init__(
        self,
        engine: Engine,
        group: dist.ProcessGroup | None = None,
        src: int = 0,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        if dist.get_rank() == src:
            raise ValueError(f"DistributedReceiver runs on engine ranks, not on src={src}")
        self.engine, self.group, self.src = engine, group, src
        self.device = _comm_device(group, device)
        self.timings: dict[str, float] = {}  # of the last receive() (its docstring)

    def _receive(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Queue the receive of one broadcast (on CUDA the host does not wait for it)."""
        t = torch.empty(numel, dtype=dtype, device=self.device)
        if numel:
            dist.broadcast(t, src=self.src, group=self.group)
        return t

    def _receive_meta(self) -> tuple[int, bytes, bytes, int]:
        """(flags, header, the header's sha256 as sent, payload length) of the next bucket: the
        one host round trip of a bucket (two when its header does not fit the meta)."""
        meta = self._receive(META_BYTES, torch.uint8).cpu().numpy().tobytes()
        wire, flags, header_len, payload_len, digest = _HEAD.unpack_from(meta)
        if wire != WIRE_VERSION:  # sizes cannot be trusted: no way to stay in step
            raise ValueError(
                f"the sender speaks sync wire version {wire}, this rank {WIRE_VERSION}: "
                "run one mxrl version on every rank"
            )
        if flags & FLAG_ABORT:
            raise ValueError("the trainer aborted the update; the engine keeps its weights")
        if _inline(header_len):
            header = meta[_HEAD_BYTES : _HEAD_BYTES + header_len]
        else:
            header = self._receive(header_len, torch.uint8).cpu().numpy().tobytes()
        return flags, header, digest, payload_len

    def _check(
        self, bucket: Bucket, payload: torch.Tensor, side: torch.cuda.Stream | None
    ) -> PendingChecksums:
        """Start the checksums of a bucket's records (views of `payload`): on CUDA queued on
        `side` behind the payload's receive, no host wait; on the CPU computed now."""
        values = [r.value for r in bucket.records]
        if side is None:
            return PendingChecksums(values)
        side.wait_stream(torch.cuda.current_stream(self.device))  # behind the payload
        if payload.numel():
            payload.record_stream(side)  # alive until the checksums have read it
        with torch.cuda.stream(side):
            return PendingChecksums(values)

    def receive(self) -> SyncReport:
        """Block until one whole update has arrived, verified and loaded. Raises ValueError
        (weights unchanged) for a refused update, after every rank has agreed on the outcome.
        `self.timings` then holds seconds since the call: `arrived` (the last payload is on
        this rank), `verified` (every checksum compared), `loaded` (`load_weights` returned;
        its copies may still run on the device)."""
        t0 = time.perf_counter()
        self.timings = {}
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if cuda else None
        arrived: list[tuple[Bucket, PendingChecksums]] = []
        error: Exception | None = None
        while True:
            flags, header, digest, payload_len = self._receive_meta()
            payload = self._receive(payload_len, torch.uint8)
            if error is None:
                try:
                    if hashlib.sha256(header).digest() != digest:
                        raise ValueError("bucket header corrupted in transit (sha256 mismatch)")
                    bucket = unpack_bucket(header, payload)
                    arrived.append((bucket, self._check(bucket, payload, side)))
                except Exception as e:  # keep receiving: the collectives stay in step
                    error = e
            if flags & FLAG_LAST:
                break
        report = None
        if error is None:
            try:
                if cuda:
                    torch.cuda.current_stream(self.device).synchronize()
                self.timings["arrived"] = time.perf_counter() - t0
                buckets = _verified(arrived)
                self.timings["verified"] = time.perf_counter() - t0
                report = apply_update(self.engine, buckets, buckets[0].plan_hash, started=t0)
                self.timings["loaded"] = time.perf_counter() - t0
            except Exception as e:  # every failure must reach the status all-gather below
                error = e
        _gather_status(int(error is not None), self.engine.weights_version, self.group, self.device)
        if error is not None:
            logger.error("sync refused on rank %d: %s", dist.get_rank(), error)
            raise error
        assert report is not None
        return report


def _verified(arrived: list[tuple[Bucket, PendingChecksums]]) -> list[Bucket]:
    """The buckets with their records as VerifiedRecords, once every bucket's checksums have
    been read (blocks for those still running); ValueError naming the records that differ."""
    records = [r for bucket, _ in arrived for r in bucket.records]
    sums = [s for _, pending in arrived for s in pending.wait()]
    verified = iter(verified_records(records, sums))
    return [
        dataclasses.replace(bucket, records=tuple(next(verified) for _ in bucket.records))
        for bucket, _ in arrived
    ]
