"""Receiving an update: every bucket of one export, then ONE `engine.load_weights` call.

Both transports (in-process here, torch.distributed in `sync/broadcast.py`) end in
`apply_update`, so they accept and refuse the same updates. `Engine.load_weights` verifies the
plan hash, the update's step (greater than the last one the engine loaded: a stale or replayed
update is refused), each record's name and fields against the plan (dtype, shape, layout of
every field), its checksum over its name and bytes (once, on the device holding it; the
distributed receiver checks each bucket's checksums as it arrives and hands `VerifiedRecord`s,
which are not checksummed again), the NVFP4 global scales' values, and that every tensor of the
plan is present, before it writes any byte of its weights (in place); the bucket checks below
(same plan hash and step, indices 0..n-1, a last bucket) run inside the stream it reads. A
failure anywhere therefore raises before anything is written: the engine keeps its previous
weights, whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from mxrl.engine import Engine
from mxrl.weights import Bucket, Export, QuantizationEvent, WeightRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncReport:
    """One applied update. version: the engine's weights_version after it; seconds: wall time
    of the whole sync (export, transfer, verification, load) as seen by the caller; event: the
    export's QuantizationEvent (None when the sender did not provide one)."""

    version: int
    num_tensors: int
    num_bytes: int
    seconds: float
    event: QuantizationEvent | None


class _Tally:
    """What one update carried, counted while the engine reads it."""

    def __init__(self) -> None:
        self.num_tensors = self.num_bytes = 0
        self.event: QuantizationEvent | None = None


def checked_records(
    buckets: Iterable[Bucket], plan_hash: str, step: int, tally: _Tally | None = None
) -> Iterator[WeightRecord]:
    """The records of one update's buckets, checking that they form one whole update of `step`
    under `plan_hash`; raises ValueError (inside the consumer, e.g. load_weights) otherwise."""
    expected = 0
    done = False
    for bucket in buckets:
        if done:
            raise ValueError(
                f"bucket {bucket.index} arrived after the last bucket of the update; "
                "the engine keeps its previous weights"
            )
        if bucket.plan_hash != plan_hash:
            raise ValueError(
                f"bucket {bucket.index} was exported under plan {bucket.plan_hash[:16]}, the "
                f"update under {plan_hash[:16]}; the engine keeps its previous weights"
            )
        if bucket.step != step:
            raise ValueError(
                f"bucket {bucket.index} comes from the export of step {bucket.step}, the update "
                f"from step {step} (a stale bucket); the engine keeps its previous weights"
            )
        if bucket.index != expected:
            raise ValueError(
                f"bucket {bucket.index} arrived where bucket {expected} was due (lost or "
                "reordered); the engine keeps its previous weights"
            )
        if bucket.num_buckets is not None and bucket.num_buckets != bucket.index + 1:
            raise ValueError(
                f"bucket {bucket.index} says the update has {bucket.num_buckets} buckets, but it "
                "is the last one; the engine keeps its previous weights"
            )
        expected += 1
        done = bucket.last
        for record in bucket.records:
            if tally is not None:
                tally.num_tensors += 1
                tally.num_bytes += record.nbytes
            yield record
        if tally is not None and bucket.event is not None:
            tally.event = bucket.event
    if not done:
        raise ValueError(
            f"incomplete update: {expected} bucket(s) arrived and none was marked last; "
            "the engine keeps its previous weights"
        )


def apply_update(
    engine: Engine,
    buckets: Iterable[Bucket],
    plan_hash: str,
    step: int,
    *,
    started: float | None = None,
    before_write: Callable[[], None] | None = None,
) -> SyncReport:
    """Load one update's buckets, the export of training step `step`, into `engine` with one
    verified, atomic `load_weights` call (`before_write`: its hook, called once the update is
    checked, before any byte is written)."""
    t0 = time.perf_counter() if started is None else started
    tally = _Tally()
    records = checked_records(buckets, plan_hash, step, tally)
    version = engine.load_weights(records, plan_hash, step=step, before_write=before_write)
    report = SyncReport(
        version=version,
        num_tensors=tally.num_tensors,
        num_bytes=tally.num_bytes,
        seconds=time.perf_counter() - t0,
        event=tally.event,
    )
    logger.info(
        "sync: engine at version %d (%d tensors, %d bytes, %.3f s)",
        version,
        report.num_tensors,
        report.num_bytes,
        report.seconds,
    )
    return report


class InProcessTransport:
    """Colocated trainer and engine (one process): the records are handed over by reference,
    quantized bucket by bucket as the engine checks them, and copied into its buffers at once.

        report = InProcessTransport(engine).send(export(model, engine.plan, step=step))
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def send(self, update: Export | Iterable[Bucket]) -> SyncReport:
        """Apply one export (or its buckets) to the engine. Raises ValueError, with the engine's
        weights unchanged, for a plan-hash mismatch, a stale or replayed step, a record that is
        not what the plan says, a tampered record or an incomplete update."""
        t0 = time.perf_counter()
        if isinstance(update, Export):
            plan_hash, step = update.plan_hash, update.step
            buckets: Iterator[Bucket] = iter(update)
        else:
            buckets = iter(update)
            first = next(buckets, None)
            if first is None:
                raise ValueError("an update without buckets: the engine keeps its weights")
            plan_hash, step = first.plan_hash, first.step
            buckets = _prepend(first, buckets)
        return apply_update(self.engine, buckets, plan_hash, step, started=t0)


def _prepend(first: Bucket, rest: Iterator[Bucket]) -> Iterator[Bucket]:
    yield first
    yield from rest
