"""Live weight export: master weights -> buckets of hashed records + one quantization event.

    exp = export(model, plan, bucket_bytes=512 * 2**20, step=step)
    for bucket in exp:  # Bucket(index, plan_hash, records, last, num_buckets, ...)
        send(bucket)
    exp.event  # QuantizationEvent(step, plan_hash, num_tensors, num_bytes, seconds, sqnr_db)

Every record comes from `mxrl.engine.export_weights`, the one export path (the engine's own
construction and checkpoint conversion use it too), so a record's bytes and hash depend only on
the master weight and its TensorSpec. `export()` quantizes the first tensor before returning, so
a master weight holding NaN/Inf (checked for every tensor by `export_weights` first) raises
there, naming the tensor, before any bucket exists.

Buckets: records are added in plan order until the next one would take the bucket past
`bucket_bytes`; a record bigger than the limit travels alone. A bucket knows it is the last one
(one record of look-ahead), and only the last one knows `num_buckets`: records are quantized as
they stream, so the total is known at the end.

SQNR (dB) per layer, against the master weights, summed in float64 while exporting (no second
quantization pass): 10*log10(sum master^2 / sum (master - dequantize(q))^2) over the quantized
tensors of a layer ("layer.{i}"), and of the tensors outside the decoder stack ("other"). Tensors
the plan keeps in bf16 are not counted: a layer without a quantized tensor has no key.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from mxrl.engine.weights import WeightRecord, export_weights
from mxrl.formats import QTensor, dequantize
from mxrl.recipe import Plan

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 2**20
OTHER = "other"  # sqnr_db key of tensors without a decoder layer (embedding, lm_head)
_SQNR_CHUNK = 1 << 22  # elements per float64 partial sum: bounds the temporary memory


@dataclass(frozen=True)
class QuantizationEvent:
    """One export of the master weights (docs/design.md §1: traceable records of every quantization).

    num_bytes: bytes of every record (quantized data, scales, global scales, bf16 tensors).
    seconds: time spent quantizing, hashing and measuring (not in the consumer of the buckets).
    sqnr_db: per-layer SQNR of the quantized tensors (module docstring); +inf for exact values.
    """

    step: int
    plan_hash: str
    num_tensors: int
    num_bytes: int
    seconds: float
    sqnr_db: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (infinite SQNRs as the strings "inf" / "-inf")."""
        d = asdict(self)
        d["sqnr_db"] = {k: v if math.isfinite(v) else str(v) for k, v in self.sqnr_db.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantizationEvent:
        sqnr = {k: float(v) for k, v in d.get("sqnr_db", {}).items()}
        return cls(
            step=int(d["step"]),
            plan_hash=str(d["plan_hash"]),
            num_tensors=int(d["num_tensors"]),
            num_bytes=int(d["num_bytes"]),
            seconds=float(d["seconds"]),
            sqnr_db=sqnr,
        )


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
        records: Iterator[WeightRecord],
        *,
        bucket_bytes: int,
        step: int,
        sqnr: bool,
        on_event: Callable[[QuantizationEvent], None] | None,
        seconds: float,
    ) -> None:
        self.plan = plan
        self.plan_hash = plan.hash()
        self.bucket_bytes = bucket_bytes
        self.step = step
        self._params = params
        self._records = records
        self._sqnr = sqnr
        self._on_event = on_event
        self._seconds = seconds
        self._started = False
        self._event: QuantizationEvent | None = None

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

    def _buckets(self) -> Iterator[Bucket]:
        signal: dict[str, float] = {}
        noise: dict[str, float] = {}
        num_tensors = num_bytes = index = 0
        pending: list[WeightRecord] = []
        pending_bytes = 0
        t0 = time.perf_counter()
        for record in self._records:
            if self._sqnr and isinstance(record.value, QTensor):
                key = _layer_key(self.plan[record.name].layer)
                s, n = _squared_sums(self._params[record.name], record.value)
                signal[key] = signal.get(key, 0.0) + s
                noise[key] = noise.get(key, 0.0) + n
            num_tensors += 1
            num_bytes += record.nbytes
            if pending and pending_bytes + record.nbytes > self.bucket_bytes:
                self._seconds += time.perf_counter() - t0
                yield Bucket(index, self.plan_hash, tuple(pending), last=False, step=self.step)
                t0 = time.perf_counter()
                index += 1
                pending, pending_bytes = [], 0
            pending.append(record)
            pending_bytes += record.nbytes
        self._seconds += time.perf_counter() - t0
        self._event = QuantizationEvent(
            step=self.step,
            plan_hash=self.plan_hash,
            num_tensors=num_tensors,
            num_bytes=num_bytes,
            seconds=self._seconds,
            sqnr_db=_sqnr_by_layer(signal, noise),
        )
        logger.info(
            "export step %d: %d tensors, %d bytes, %d bucket(s), %.3f s",
            self.step,
            num_tensors,
            num_bytes,
            index + 1,
            self._seconds,
        )
        if self._on_event is not None:
            self._on_event(self._event)
        yield Bucket(
            index,
            self.plan_hash,
            tuple(pending),
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
    sqnr: bool = True,
    on_event: Callable[[QuantizationEvent], None] | None = None,
    bf16_dtype: torch.dtype = torch.bfloat16,
) -> Export:
    """Export the master weights of `model` (a module, or name -> tensor) under `plan`.

    Raises ValueError, before returning and so before any bucket exists, for a master weight
    holding NaN/Inf (naming it) and for weights that do not match the plan. sqnr=False skips the
    per-layer SQNR (one dequantization per quantized tensor). on_event is called with the
    QuantizationEvent when the last bucket is produced.
    """
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a resolved mxrl.recipe.Plan, got {type(plan).__name__}")
    if len(plan) == 0:
        raise ValueError("the plan holds no tensor: there is nothing to export")
    t0 = time.perf_counter()
    params = dict(model.named_parameters() if isinstance(model, nn.Module) else model)
    records = export_weights(params, plan, bf16_dtype=bf16_dtype)
    # export_weights checks every tensor for NaN/Inf before its first record: pulling that record
    # here makes the refusal happen now, before anything can be sent.
    first = next(records)
    stream = _chain(first, records)
    return Export(
        params,
        plan,
        stream,
        bucket_bytes=bucket_bytes,
        step=step,
        sqnr=sqnr,
        on_event=on_event,
        seconds=time.perf_counter() - t0,
    )


def _chain(first: WeightRecord, rest: Iterator[WeightRecord]) -> Iterator[WeightRecord]:
    yield first
    yield from rest


def _layer_key(layer: int | None) -> str:
    return OTHER if layer is None else f"layer.{layer}"


@torch.no_grad()
def _squared_sums(master: torch.Tensor, q: QTensor) -> tuple[float, float]:
    """(sum master^2, sum (master - dequantize(q))^2) in float64; expert by expert for 3-D
    tensors so the temporary float32 copy is one expert, not the whole tensor."""
    master = master.detach()
    if master.dim() == 3 and q.axis in (-1, 1, 2):
        s = n = 0.0
        for e in range(master.shape[0]):
            se, ne = _squared_sums_2d(master[e], _expert(q, e))
            s, n = s + se, n + ne
        return s, n
    return _squared_sums_2d(master, q)


def _squared_sums_2d(master: torch.Tensor, q: QTensor) -> tuple[float, float]:
    ref = master.reshape(-1)
    approx = dequantize(q).reshape(-1)
    s = n = 0.0
    for i in range(0, ref.numel(), _SQNR_CHUNK):
        r = ref[i : i + _SQNR_CHUNK].to(torch.float64)
        err = r - approx[i : i + _SQNR_CHUNK].to(device=r.device, dtype=torch.float64)
        s += float(torch.dot(r, r))
        n += float(torch.dot(err, err))
    return s, n


def _expert(q: QTensor, e: int) -> QTensor:
    """Expert e of a 3-D QTensor (every field is batched over dim 0)."""
    gs = q.global_scale
    if gs is not None and gs.dim() > 0:
        gs = gs[e]
    axis = q.axis if q.axis == -1 else q.axis - 1
    return QTensor(q.qdata[e], q.scale[e], q.fmt, q.shape[1:], axis, gs)


def _sqnr_by_layer(signal: dict[str, float], noise: dict[str, float]) -> dict[str, float]:
    def order(key: str) -> tuple[int, int]:
        return (1, 0) if key == OTHER else (0, int(key.split(".")[1]))

    out = {}
    for key in sorted(signal, key=order):
        s, n = signal[key], noise[key]
        out[key] = math.inf if n == 0.0 else (-math.inf if s == 0.0 else 10 * math.log10(s / n))
    return out
