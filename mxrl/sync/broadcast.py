"""Weight sync over torch.distributed: one trainer rank broadcasts, engine ranks verify and load
(the receiving end: `mxrl.sync.broadcast_receive`).

    # trainer rank (src)                          # every engine rank
    sender = BroadcastSender(group, src=0)      receiver = BroadcastReceiver(engine, group, src=0)
    sender.send(export(model, plan, step=s))      receiver.receive()

Every rank of `group` takes part: `src` sends, all others receive (gloo on CPU tensors, NCCL on
the current CUDA device). The sender quantizes bucket k+1 while bucket k is on the wire: on CUDA
the export and the packing run on a side stream and the payload broadcast is asynchronous, with
at most two payloads alive (the one in transfer, the one being built); on gloo / CPU the steps
run one after the other.

An update opens with one all-gather of (wire version, layout id) (wire version 5). The layout is
where every field of an update lies in its payloads: the bucket headers without the checksums,
the step and the event (`PayloadLayout`). It follows from the plan, the bucket size and the dtype of
the bf16 tensors, so every update of a run after the first has the one layout both ends learnt
from the first. When every rank
holds the same layout the update runs **scheduled**, otherwise **bucket by bucket** (the first
update, a new sender or engine rank, another plan or bucket size, after a refused layout); both
ends remember the layout of an update that went through bucket by bucket. Ranks of different
wire versions from 4 on all refuse at that all-gather; an older rank does not take part in it
(run one mxrl version on every rank).

The messages of each mode are `mxrl.sync.wire`'s.

The receive pipeline, both modes: each bucket's checksums are queued behind its payload (CUDA:
on a side stream, their 64 bytes per field copied to pinned host memory behind an event; gloo /
CPU: computed at once): bucket k is verified while bucket k+1 is on the wire. After the last
bucket the receiver reads the digests (only the last bucket's can still be running), compares
every record's checksum with the one it carries, and hands the records to ONE
`Engine.load_weights` call (`transport.apply_update`) as `VerifiedRecord`s, which it does not
checksum again (once on send, once on receive), before it copies anything into the engine's
buffers. A receiver keeps receiving to the last bucket even after an error, so the collectives
stay in step; then all ranks all-gather (failed, weights_version): an engine rank does so inside
`load_weights`, once its update is checked and staged and before the first byte is written
(`before_write`), or at once when it has already failed. A refusal on any engine rank makes every
engine rank keep its weights and raises on the sender too, naming the refusing ranks. Nothing is
half-applied, on any rank, short of a failed memory allocation during the copies that follow
that all-gather. Memory: every payload of the update (all or
nothing), plus the checksums' workspace of the buckets being verified (1/32 of their bytes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from mxrl.sync import wire
from mxrl.sync.transport import SyncReport
from mxrl.sync.wire import (
    FLAG_ABORT,
    FLAG_LAST,
    WIRE_VERSION,
    PayloadLayout,
    pack_bucket,
)
from mxrl.weights import (
    Bucket,
    Export,
)

logger = logging.getLogger(__name__)

Tamper = Callable[[int, torch.Tensor], None]


def comm_device(group: dist.ProcessGroup | None, device: torch.device | str | None):
    if device is not None:
        return torch.device(device)
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_status(
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


def agree_on_layout(
    layout: PayloadLayout | None, group: dist.ProcessGroup | None, device: torch.device
) -> bool:
    """Whether every rank of `group` holds this same layout (the update then runs scheduled):
    one all-gather of (wire version, layout id); every rank reaches the same answer."""
    ident = layout.id if layout is not None else bytes(16)
    mine = torch.tensor([WIRE_VERSION, *struct.unpack("<2q", ident)], dtype=torch.int64)
    everyone = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine.to(device), group=group)
    seen = {tuple(t.tolist()) for t in everyone}
    wires = sorted({w for w, _, _ in seen})
    if wires != [WIRE_VERSION]:  # every rank sees the same set and raises together
        raise ValueError(
            f"the ranks speak sync wire versions {wires}: run one mxrl version on every rank"
        )
    return len(seen) == 1 and seen != {(WIRE_VERSION, 0, 0)}


def _layout_key(update: Export) -> tuple[str, int, str] | None:
    """What the export's layout follows from (plan, bucket size, the dtype of its bf16
    tensors); None for an update that does not say (it is then sent bucket by bucket)."""
    key = [getattr(update, a, None) for a in ("plan_hash", "bucket_bytes", "bf16_dtype")]
    return None if None in key else (str(key[0]), int(key[1]), str(key[2]))


class _PayloadLayoutChanged(Exception):
    """The export does not match the layout both ends agreed on (the sender's own check)."""


# --- the two ends ------------------------------------------------------------------------------
class BroadcastSender:
    """The trainer end: broadcasts each bucket of an export from rank `src` (a global rank) to
    every other rank of `group` (None: the default group).

    tamper: tests only; called as tamper(bucket_index, payload) before the payload is broadcast,
    to corrupt bytes in transit on purpose. `last_mode`: "per-bucket" or "scheduled", how the
    last `send` ran (module docstring).
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
                f"BroadcastSender runs on rank src={src}, this is rank {dist.get_rank()}"
            )
        self.group, self.src, self.tamper = group, src, tamper
        self.device = comm_device(group, device)
        self.last_mode: str | None = None
        self._layout: tuple[tuple[str, int, str], PayloadLayout] | None = (
            None  # (key, layout) last sent
        )

    def _broadcast(self, t: torch.Tensor, *, async_op: bool = False):
        return dist.broadcast(t, src=self.src, group=self.group, async_op=async_op)

    def _send_meta(self, flags: int, header: bytes, payload_len: int) -> None:
        self._broadcast(wire.meta_message(flags, header, payload_len, self.device))
        if not wire.fits_inline(len(header)):
            self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))

    def send(self, update: Export) -> SyncReport:
        """Broadcast one export; returns once every engine rank has verified and loaded it.
        Raises ValueError when any engine rank refused it (they all keep their weights)."""
        t0 = time.perf_counter()
        key = _layout_key(update)
        layout = self._layout[1] if self._layout is not None and self._layout[0] == key else None
        if agree_on_layout(layout, self.group, self.device):
            assert layout is not None
            self.last_mode = "scheduled"
            return self._send_scheduled(update, layout, t0)
        self.last_mode = "per-bucket"
        report, headers = self._send_per_bucket(update, t0)
        self._layout = (key, PayloadLayout.of(headers)) if key is not None else None
        return report

    def _pack(self, buckets, side) -> tuple[Bucket | None, bytes, torch.Tensor | None]:
        """The next bucket of the export, quantized and packed (on CUDA: on the side stream,
        while the payload before it transfers); (None, b"", None) after the last."""
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            bucket = next(buckets, None)
            if bucket is None:
                return None, b"", None
            header, payload = pack_bucket(bucket, self.device)
        if side is not None:  # the broadcasts (current stream) follow the side stream
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(side)
            payload.record_stream(current)
        if self.tamper is not None:
            self.tamper(bucket.index, payload)
        return bucket, header, payload

    def _send_per_bucket(self, update: Export, t0: float) -> tuple[SyncReport, list[dict]]:
        num_tensors = num_bytes = 0
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        inflight: deque = deque()  # (work, payload) of the payloads on the wire
        buckets = iter(update)
        headers: list[dict] = []
        while True:
            try:
                bucket, header, payload = self._pack(buckets, side)
            except Exception:
                # The export failed mid-way: tell the receivers, so that no rank waits forever.
                self._finish(inflight)
                self._send_meta(FLAG_ABORT, b"", 0)
                raise
            if bucket is None:
                break
            assert payload is not None
            headers.append(json.loads(header))
            self._send_meta(FLAG_LAST if bucket.last else 0, header, payload.numel())
            if payload.numel():
                inflight.append((self._broadcast(payload, async_op=True), payload))
            self._finish(inflight, keep=1)  # bounded memory: one in transfer, one being built
            num_tensors += bucket.num_tensors
            num_bytes += bucket.nbytes
        self._finish(inflight)
        report = self._outcome(update, t0, num_tensors, num_bytes)
        return report, headers

    def _send_scheduled(self, update: Export, layout: PayloadLayout, t0: float) -> SyncReport:
        """Every payload back to back, sized by `layout` (the receivers have queued all their
        receives), then one trailer with the records' checksums, the step and the event."""
        num_tensors = num_bytes = 0
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        inflight: deque = deque()
        buckets = iter(update)
        failure: Exception | None = None
        hashes: list[str] = []
        last: Bucket | None = None
        for k, expected in enumerate(layout.buckets):
            payload = None
            if failure is None:
                try:
                    bucket, header, payload = self._pack(buckets, side)
                    if bucket is None:
                        raise _PayloadLayoutChanged(f"the export ended after {k} bucket(s)")
                    if wire.bucket_layout(json.loads(header)) != expected:
                        raise _PayloadLayoutChanged(f"bucket {k} is laid out differently")
                    hashes += [r.hash for r in bucket.records]
                    num_tensors += bucket.num_tensors
                    num_bytes += bucket.nbytes
                    last = bucket
                except Exception as e:
                    failure, payload = e, None
            if payload is None:  # after a failure: keep every rank's queued receives in step
                payload = torch.zeros(
                    expected["payload_bytes"], dtype=torch.uint8, device=self.device
                )
            if payload.numel():
                inflight.append((self._broadcast(payload, async_op=True), payload))
            self._finish(inflight, keep=1)
        if failure is None and (last is None or not last.last):
            failure = _PayloadLayoutChanged(
                f"the export has more than {len(layout.buckets)} bucket(s)"
            )
        self._finish(inflight)
        if failure is not None:
            self._send_meta(FLAG_ABORT, b"", 0)
            if not isinstance(failure, _PayloadLayoutChanged):
                raise failure
            self._layout = None  # the next update goes bucket by bucket and learns the layout
            raise ValueError(
                f"weight update step {update.step}: {failure}, unlike the {len(layout.buckets)} "
                "bucket(s) of the layout the ranks agreed on; nothing was loaded (every engine "
                "rank keeps its weights) and the next update is sent bucket by bucket"
            )
        assert last is not None  # the layout has at least one bucket, and none failed
        trailer = {
            "wire": WIRE_VERSION,
            "plan_hash": last.plan_hash,
            "step": last.step,
            "event": last.event.to_dict() if last.event is not None else None,
            "hashes": hashes,
        }
        self._send_meta(FLAG_LAST, json.dumps(trailer, separators=(",", ":")).encode(), 0)
        return self._outcome(update, t0, num_tensors, num_bytes)

    def _outcome(self, update: Export, t0: float, num_tensors: int, num_bytes: int) -> SyncReport:
        engines = [s for s in gather_status(0, 0, self.group, self.device) if s[0] != self.src]
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
