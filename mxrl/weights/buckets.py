"""Live weight export: master weights -> buckets of checksummed records + one quantization event.

    exp = export(model, plan, bucket_bytes=512 * 2**20, step=step)
    for bucket in exp:  # Bucket(index, plan_hash, records, last, num_buckets, step, event)
        send(bucket)
    exp.event  # QuantizationEvent(step, plan_hash, num_tensors, num_bytes, seconds, sqnr_db)

Every value comes from `quantized_values`, the one export path (the engine's own construction
and checkpoint conversion use it too), quantized on the master's device, so a record's bytes and
checksum depend only on the master weight and its TensorSpec. `export()` queues the NaN/Inf
check of every master weight (`mxrl.weights.finite.FiniteCheck`) and returns without waiting
for it; the first bucket reads its verdict where it reads its checksums, so a master weight
holding NaN/Inf raises there, naming the tensor, before any bucket exists.

Buckets: records are added in plan order until the next one would take the bucket past
`bucket_bytes`; a record bigger than the limit travels alone. Records are quantized as the
buckets are pulled (one bucket, plus the one record of look-ahead that tells a bucket it is the
last, exists at a time on the export's side), and a bucket's checksums are computed together,
on the device, with one host read per bucket. Only the last bucket knows `num_buckets`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mxrl.formats import QTensor
from mxrl.formats.constants import Format
from mxrl.kernels import Backend
from mxrl.kernels.backend import backend_for
from mxrl.recipe import Plan
from mxrl.weights.digest import PendingChecksums
from mxrl.weights.event import QuantizationEvent, SqnrMeter, SqnrSample
from mxrl.weights.export import check_names, quantized_values
from mxrl.weights.finite import FiniteCheck, detached
from mxrl.weights.record import WeightRecord, WeightValue, value_nbytes

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 2**20
# One bucket for the whole update: an engine in the exporting process holds every record until
# it loads them all (`Engine.load_weights` is all or nothing), so buckets there buy no memory,
# and each one costs a host read of its checksums, which stalls the device between buckets.
WHOLE_UPDATE = 1 << 62


@dataclass(frozen=True)
class Bucket:
    """A transfer unit of one update: consecutive records of the plan, in plan order.

    index: 0, 1, ... within the update; last: no bucket follows; num_buckets: the total, set on
    the last bucket (None before). event: the update's QuantizationEvent, on the last bucket.
    """

    index: int
    plan_hash: str
    records: tuple[WeightRecord, ...]
    last: bool
    num_buckets: int | None = None
    step: int = 0
    event: QuantizationEvent | None = None

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    @property
    def num_tensors(self) -> int:
        return len(self.records)


class Export:
    """The buckets of one export, produced lazily as they are iterated (once). Build it with
    `export()`; `event` is available once the last bucket has been produced."""

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        plan: Plan,
        values: Iterator[tuple[str, WeightValue]],
        *,
        bucket_bytes: int,
        step: int,
        sqnr: bool | SqnrSample,
        on_event: Callable[[QuantizationEvent], None] | None,
        seconds: float,
        bf16_dtype: torch.dtype = torch.bfloat16,
        check: FiniteCheck | None = None,
        sums: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.plan = plan
        self.plan_hash = plan.hash()
        self.bucket_bytes = bucket_bytes
        self.bf16_dtype = bf16_dtype
        self.step = step
        self._params = params
        self._values = values
        self._sample = SqnrSample.of(sqnr)  # None: no SQNR
        self._on_event = on_event
        self._seconds = seconds
        self._check = check  # the masters' NaN/Inf verdict, read by the first bucket
        self._sums = {} if sums is None else sums  # the SQNR's parts the quantizers kept
        self._started = False
        self._event: QuantizationEvent | None = None
        self.hashes: dict[str, str] = {}  # name -> checksum of every record produced so far

    @property
    def event(self) -> QuantizationEvent:
        if self._event is None:
            raise RuntimeError(
                "the quantization event is complete once the last bucket has been produced; "
                "iterate the export to the end first"
            )
        return self._event

    def records(self) -> Iterator[WeightRecord]:
        """The records of every bucket, in plan order (consumes the export)."""
        for bucket in self:
            yield from bucket.records

    def __iter__(self) -> Iterator[Bucket]:
        if self._started:
            raise RuntimeError(
                "an Export is iterated once (it is one quantization event); call export() again"
            )
        self._started = True
        return self._buckets()

    def _records(self, pending: list[tuple[str, WeightValue]]) -> tuple[WeightRecord, ...]:
        sums = PendingChecksums([n for n, _ in pending], [v for _, v in pending])
        if self._check is not None:  # the first bucket: nothing exists to be sent before it
            # checked on the values: this bucket must hold every one of them
            assert not self._check.on_values or len(pending) == len(self.plan)
            self._check.result()  # raises naming every master weight holding NaN/Inf
            self._check = None
        return tuple(  # one host read: the checksums
            WeightRecord(n, v, h) for (n, v), h in zip(pending, sums.wait(), strict=True)
        )

    def _buckets(self) -> Iterator[Bucket]:
        meter = SqnrMeter(self._sample)
        num_tensors = num_bytes = index = 0
        pending: list[tuple[str, WeightValue]] = []
        pending_bytes = 0
        t0 = time.perf_counter()
        for name, value in self._values:
            nbytes = value_nbytes(value)
            parts = self._sums.pop(name, None)  # what its quantizer measured, if it did
            if self._sample is not None and isinstance(value, QTensor):
                meter.add(self.plan[name].layer, self._params[name], value, parts=parts)
            if self._check is not None and self._check.on_values:
                self._check.add(name, value, parts)
            num_tensors += 1
            num_bytes += nbytes
            if pending and pending_bytes + nbytes > self.bucket_bytes:
                records = self._records(pending)
                self.hashes.update((r.name, r.hash) for r in records)
                bucket = Bucket(index, self.plan_hash, records, last=False, step=self.step)
                self._seconds += time.perf_counter() - t0
                yield bucket
                t0 = time.perf_counter()
                index += 1
                pending, pending_bytes = [], 0
            pending.append((name, value))
            pending_bytes += nbytes
        meter.queue()  # its copy to the host behind the last quantizer, read after the records'
        records = self._records(pending)
        self.hashes.update((r.name, r.hash) for r in records)
        sqnr_db = meter.result()
        self._seconds += time.perf_counter() - t0
        self._event = QuantizationEvent(
            step=self.step,
            plan_hash=self.plan_hash,
            num_tensors=num_tensors,
            num_bytes=num_bytes,
            seconds=self._seconds,
            sqnr_db=sqnr_db,
        )
        logger.info(
            "export step %d: %d tensors, %d bytes, %d bucket(s), %.3f s",
            self.step, num_tensors, num_bytes, index + 1, self._seconds,
        )  # fmt: skip
        if self._on_event is not None:
            self._on_event(self._event)
        yield Bucket(
            index,
            self.plan_hash,
            records,
            last=True,
            num_buckets=index + 1,
            step=self.step,
            event=self._event,
        )


def export(
    model: nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    plan: Plan,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    step: int = 0,
    sqnr: bool | SqnrSample = True,
    on_event: Callable[[QuantizationEvent], None] | None = None,
    bf16_dtype: torch.dtype = torch.bfloat16,
    backend: Backend | str | None = None,
) -> Export:
    """Export the master weights of `model` (a module, or name -> tensor) under `plan`, on
    their device (`backend`: the quantizer, default Triton on CUDA; the same bytes anywhere).

    step: the training step the weights come from; every bucket carries it, and an engine takes
    an update only at a step greater than the last one it loaded (mxrl/engine/loading.py).
    Raises ValueError for weights that do not match the plan (before returning) and for a
    master weight holding NaN/Inf, naming it: that check is queued before returning and read
    as the first bucket is produced, so before any bucket exists (`FiniteCheck`; the
    quantizers are queued behind it without waiting for its verdict). sqnr=False skips the
    per-layer SQNR (one dequantization per quantized tensor); a `SqnrSample` measures a share of
    each expert stack (mxrl/weights/event.py). on_event is called with the
    QuantizationEvent when the last bucket is produced.
    """
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(
            f"step must be a training step (an int >= 0), got {step!r}: engines take an update "
            "only at a step greater than the last one they loaded"
        )
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a resolved mxrl.recipe.Plan, got {type(plan).__name__}")
    if len(plan) == 0:
        raise ValueError("the plan holds no tensor: there is nothing to export")
    t0 = time.perf_counter()
    named = dict(model.named_parameters() if isinstance(model, nn.Module) else model)
    params = {name: detached(t) for name, t in named.items()}  # once: check, quantize, SQNR
    check_names(params, plan)
    for device in {params[n].device for n, spec in plan.items() if spec.format is not Format.BF16}:
        backend_for(backend, device)  # an unknown or unusable quantizer backend: refused now
    # every tensor's NaN/Inf check queued, not read: the quantizers follow it at once, and the
    # first bucket reads its verdict beside its checksums (Export._records). On one bucket
    # (WHOLE_UPDATE) every value exists before anything is sent: each tensor but an NVFP4 one
    # is checked on its exported bytes, 1 or 2 an element where its master holds 4, or on the
    # non-finite count its quantizer took while reading the master (nothing read again).
    on_values = bucket_bytes >= WHOLE_UPDATE
    check = FiniteCheck(params, plan, on_values=on_values, bf16_dtype=bf16_dtype)
    # the SQNR's terms and the non-finite counts, summed by the quantizers as they read each
    # master (`quantize_measured`): no second read of it for the SQNR or the check
    sums: dict[str, torch.Tensor] | None = {} if on_values or SqnrSample.of(sqnr) else None
    values = quantized_values(
        params, plan, bf16_dtype=bf16_dtype, backend=backend, check=check, sums=sums
    )
    return Export(
        params,
        plan,
        values,
        check=check,
        bucket_bytes=bucket_bytes,
        step=step,
        sqnr=sqnr,
        on_event=on_event,
        seconds=time.perf_counter() - t0,
        bf16_dtype=bf16_dtype,
        sums=sums,
    )
