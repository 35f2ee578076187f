"""The engine end of the torch.distributed weight sync (`mxrl.sync.broadcast` has the protocol,
the sender and the layout agreement both ends run): `BroadcastReceiver` receives one update per
`receive()`, verifies each bucket as it arrives and loads the whole update or nothing."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import time

import torch
import torch.distributed as dist

from mxrl.engine import Engine
from mxrl.sync import wire
from mxrl.sync.broadcast import Tamper, agree_on_layout, comm_device, gather_status
from mxrl.sync.transport import SyncReport, apply_update
from mxrl.sync.wire import (
    FLAG_ABORT,
    FLAG_LAST,
    WIRE_VERSION,
    PayloadLayout,
    unpack_bucket,
)
from mxrl.weights import (
    Bucket,
    PendingChecksums,
    QuantizationEvent,
    verified_records,
)

logger = logging.getLogger(__name__)


class BroadcastReceiver:
    """The engine end: receives one update from rank `src` per `receive()` call and loads it
    into `engine` (see the module docstring for what is checked). `last_mode`: "per-bucket" or
    "scheduled", how the last `receive` ran.

    tamper: tests only; called as tamper(bucket_index, payload) once a payload's receive is
    queued, before its checksums, to corrupt the bytes this rank received on purpose.
    """

    def __init__(
        self,
        engine: Engine,
        group: dist.ProcessGroup | None = None,
        src: int = 0,
        *,
        device: torch.device | str | None = None,
        tamper: Tamper | None = None,
    ) -> None:
        if dist.get_rank() == src:
            raise ValueError(f"BroadcastReceiver runs on engine ranks, not on src={src}")
        self.engine, self.group, self.src, self.tamper = engine, group, src, tamper
        self.device = comm_device(group, device)
        self.timings: dict[str, float] = {}  # of the last receive() (its docstring)
        self.last_mode: str | None = None
        self._layout: PayloadLayout | None = None  # of the last update this rank loaded

    def _receive(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Queue the receive of one broadcast (on CUDA the host does not wait for it)."""
        t = torch.empty(numel, dtype=dtype, device=self.device)
        if numel:
            dist.broadcast(t, src=self.src, group=self.group)
        return t

    def _receive_meta(self) -> tuple[int, bytes, bytes, int]:
        """(flags, header, the header's sha256 as sent, payload length) of the next meta: one
        host round trip (two when its header does not fit the meta)."""
        meta = self._receive(wire.META_BYTES, torch.uint8).cpu().numpy().tobytes()
        version, flags, header_len, payload_len, digest = wire.HEAD.unpack_from(meta)
        if version != WIRE_VERSION:  # sizes cannot be trusted: no way to stay in step
            raise ValueError(
                f"the sender speaks sync wire version {version}, this rank {WIRE_VERSION}: "
                "run one mxrl version on every rank"
            )
        if flags & FLAG_ABORT:
            raise ValueError("the trainer aborted the update; the engine keeps its weights")
        if wire.fits_inline(header_len):
            header = meta[wire.HEAD_BYTES : wire.HEAD_BYTES + header_len]
        else:
            header = self._receive(header_len, torch.uint8).cpu().numpy().tobytes()
        return flags, header, digest, payload_len

    def _check(
        self, records: list, payload: torch.Tensor, side: torch.cuda.Stream | None
    ) -> PendingChecksums:
        """Start the checksums of a bucket's records (their values views of `payload`): on
        CUDA queued on `side` behind the payload's receive, no host wait; on the CPU now."""
        names, values = [r.name for r in records], [r.value for r in records]
        if side is None:
            return PendingChecksums(names, values)
        side.wait_stream(torch.cuda.current_stream(self.device))  # behind the payload
        if payload.numel():
            payload.record_stream(side)  # alive until the checksums have read it
        with torch.cuda.stream(side):
            return PendingChecksums(names, values)

    def receive(self) -> SyncReport:
        """Block until one whole update has arrived, verified and loaded. Raises ValueError
        (weights unchanged) for a refused update, after every rank has agreed on the outcome.
        `self.timings` then holds seconds since the call: `arrived` (the last payload is on
        this rank), `verified` (every checksum compared), `loaded` (`load_weights` returned;
        its copies may still run on the device)."""
        t0 = time.perf_counter()
        self.timings = {}
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        layout = self._layout
        if agree_on_layout(layout, self.group, self.device):
            assert layout is not None
            self.last_mode = "scheduled"
            arrived, error = self._receive_scheduled(layout, side)
            headers = None
        else:
            self.last_mode = "per-bucket"
            arrived, error, headers = self._receive_per_bucket(side)
        report = None
        agreed = False

        def agree() -> None:
            """Every engine rank checked its update and can load it, or none loads: the status
            all-gather, right before the first byte is written."""
            nonlocal agreed
            agreed = True
            version = self.engine.weights_version + 1
            status = gather_status(0, version, self.group, self.device)
            refused = [rank for rank, failed, _ in status if failed]
            if refused:
                raise ValueError(
                    f"engine rank(s) {refused} refused this update, so this rank does not load "
                    "it either (all or nothing across the engine ranks); it keeps its weights"
                )

        if error is None:
            try:
                if side is not None:
                    torch.cuda.current_stream(self.device).synchronize()
                self.timings["arrived"] = time.perf_counter() - t0
                buckets = _verified(arrived)
                self.timings["verified"] = time.perf_counter() - t0
                plan_hash, step = buckets[0].plan_hash, buckets[0].step
                report = apply_update(
                    self.engine, buckets, plan_hash, step, started=t0, before_write=agree
                )
                self.timings["loaded"] = time.perf_counter() - t0
            except Exception as e:  # every failure must reach the status all-gather
                error = e
        if not agreed:  # this rank failed before agree(): it still takes part in the all-gather
            gather_status(1, self.engine.weights_version, self.group, self.device)
        if error is not None:
            logger.error("sync refused on rank %d: %s", dist.get_rank(), error)
            raise error
        assert report is not None
        if headers is not None:
            self._layout = PayloadLayout.of(headers)
        return report

    def _receive_per_bucket(self, side):
        """Meta, then payload, bucket by bucket: (arrived, the first error, the headers)."""
        arrived: list[tuple[Bucket, PendingChecksums]] = []
        headers: list[dict] = []
        error: Exception | None = None
        for index in itertools.count():
            flags, header, digest, payload_len = self._receive_meta()
            payload = self._receive(payload_len, torch.uint8)
            if self.tamper is not None:
                self.tamper(index, payload)
            if error is None:
                try:
                    if hashlib.sha256(header).digest() != digest:
                        raise ValueError("bucket header corrupted in transit (sha256 mismatch)")
                    bucket = unpack_bucket(header, payload)
                    headers.append(json.loads(header))
                    arrived.append((bucket, self._check(list(bucket.records), payload, side)))
                except Exception as e:  # keep receiving: the collectives stay in step
                    error = e
            if flags & FLAG_LAST:
                break
        return arrived, error, headers

    def _receive_scheduled(self, layout: PayloadLayout, side):
        """Every payload's receive queued at once, sized by `layout`, each bucket's checksums
        behind it; then the trailer (one host round trip): (arrived, the first error). Every
        receive is queued whatever fails on the way, so the collectives stay in step."""
        staged = []
        error: Exception | None = None
        for k, lay in enumerate(layout.buckets):
            payload = self._receive(lay["payload_bytes"], torch.uint8)
            if self.tamper is not None:
                self.tamper(k, payload)
            if error is None:
                try:
                    records = [
                        wire.record_views({**r, "hash": ""}, payload) for r in lay["records"]
                    ]
                    staged.append((records, self._check(records, payload, side)))
                except Exception as e:  # keep receiving: the collectives stay in step
                    error = e
        flags, trailer, digest, _ = self._receive_meta()  # after the last payload: in step
        if error is not None:
            return [], error
        try:
            return self._arrived(staged, layout, flags, trailer, digest), None
        except ValueError as e:
            return [], e
        except Exception as e:  # whatever a malformed trailer raises: refused, still in step
            return [], ValueError(f"malformed update trailer ({e!r}); the update is refused")

    @staticmethod
    def _arrived(staged, layout: PayloadLayout, flags: int, trailer: bytes, digest: bytes):
        """The buckets of a scheduled update, their records' checksums from the trailer."""
        if hashlib.sha256(trailer).digest() != digest:
            raise ValueError("update trailer corrupted in transit (sha256 mismatch)")
        t = json.loads(trailer.decode())
        hashes = [str(h) for h in t["hashes"]]
        if len(hashes) != sum(len(records) for records, _ in staged):
            raise ValueError("the update trailer does not list one checksum per record")
        if t["plan_hash"] != layout.plan_hash or not flags & FLAG_LAST:
            raise ValueError("the update trailer does not close the agreed layout")
        step = int(t["step"])
        event = QuantizationEvent.from_dict(t["event"]) if t["event"] is not None else None
        named = iter(hashes)
        n = len(staged)
        return [
            (
                Bucket(
                    index=k,
                    plan_hash=layout.plan_hash,
                    records=tuple(dataclasses.replace(r, hash=next(named)) for r in records),
                    last=k == n - 1,
                    num_buckets=n if k == n - 1 else None,
                    step=step,
                    event=event if k == n - 1 else None,
                ),
                pending,
            )
            for k, (records, pending) in enumerate(staged)
        ]


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
