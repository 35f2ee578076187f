"""Weight export from FSDP2-sharded master weights: the bytes a single-process export of the
same (whole) master gives, record for record, checksum for checksum.

FSDP2 shards every parameter on dim 0 (torch.chunk: ceil(rows / ranks) rows per rank, the last
ranks shorter or empty). Per tensor of the plan, in plan order (every rank of the train group
calls this, in lockstep: it is collective):

- **shard-local** when every rank holds at least one row and no quantization block crosses a
  shard boundary: MXFP8 and NVFP4 blocks run along the last dim (rows are independent); block
  FP8 needs shard rows that are a multiple of its row block (always so for 3-D expert tensors,
  sharded by expert); bf16 is a cast. Each rank quantizes its rows; the NVFP4 global amax of a
  2-D tensor (and of its gate/up partner) is first all-reduced (MAX) over the shards, so every
  shard encodes with the whole tensor's scale; a 3-D expert tensor's amax is per expert (and
  per gate/up half), inside one shard. Then the fields (qdata, scale, global_scale, as uint8)
  are all-gathered, padded to the chunk size, and trimmed: 8.25 (MXFP8) or 4.5 (NVFP4) bits per
  weight cross the wire instead of 32.
- **gathered** otherwise: the fp32 master is all-gathered (`DTensor.full_tensor`) and
  quantized whole, exactly as on one process.

Either way every rank of the group ends with the whole record (colocated engines load it;
in the split placement train rank 0 broadcasts it to the rollout ranks). NaN/Inf anywhere is
refused on every rank before any value (one all-reduce of per-tensor flags). SQNR per layer is
summed shard-locally and all-reduced.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mxrl.formats import QTensor
from mxrl.formats.constants import FP8_BLOCK_WEIGHT, Format
from mxrl.kernels import Backend, Kernels
from mxrl.kernels import quantize as kernel_quantize
from mxrl.kernels.api import KERNEL_FP8_BLOCK_SIZES
from mxrl.kernels.backend import backend_for
from mxrl.recipe import Plan, TensorSpec
from mxrl.recipe.quantize import weight_amax
from mxrl.weights import DEFAULT_BUCKET_BYTES, Bucket, Export, QuantizationEvent, check_finite
from mxrl.weights.event import OTHER, SqnrMeter, SqnrSample
from mxrl.weights.export import check_names, fuse_partners
from mxrl.weights.finite import narrowed
from mxrl.weights.record import WeightValue


class ShardedExport:
    """The buckets of one export from sharded masters (iterate once, on every train rank).
    Quacks like `mxrl.weights.Export` for the transports: `step`, `plan_hash`, `event`."""

    def __init__(self, inner: Export, sqnr: _Tally | None, tally: _Tally) -> None:
        self._inner, self._sqnr, self._tally = inner, sqnr, tally
        self.step, self.plan_hash, self.plan = inner.step, inner.plan_hash, inner.plan
        self._event: QuantizationEvent | None = None

    @property
    def event(self) -> QuantizationEvent:
        if self._event is None:
            raise RuntimeError("iterate the export to its last bucket first")
        return self._event

    @property
    def num_shard_local(self) -> int:
        """Tensors quantized shard-locally so far (the rest were gathered whole)."""
        return self._tally.num_shard_local

    @property
    def num_gathered(self) -> int:
        return self._tally.num_gathered

    def records(self):
        for bucket in self:
            yield from bucket.records

    def __iter__(self) -> Iterator[Bucket]:
        for bucket in self._inner:
            if bucket.last:
                event = bucket.event
                assert event is not None
                if self._sqnr is not None:
                    event = dataclasses.replace(event, sqnr_db=self._sqnr.result)
                self._event = event
                bucket = dataclasses.replace(bucket, event=event)
            yield bucket


class _Tally:
    def __init__(self, sample: SqnrSample | None) -> None:
        self.meter = SqnrMeter(sample)
        self.result: dict[str, float] = {}
        self.num_shard_local = self.num_gathered = 0


def sharded_export(
    model: nn.Module,
    plan: Plan,
    group: dist.ProcessGroup,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    step: int = 0,
    sqnr: bool | SqnrSample = True,
    bf16_dtype: torch.dtype = torch.bfloat16,
    backend: Kernels | Backend | str | None = None,
) -> ShardedExport:
    """Export a model whose parameters are FSDP2 DTensors (or plain tensors, held whole) under
    `plan`; collective over `group` (the train ranks). Raises ValueError on every rank, before
    any bucket, for NaN/Inf in any shard or weights that do not match the plan."""
    t0 = time.perf_counter()
    params = {n: p.detach() for n, p in model.named_parameters()}
    check_names(params, plan, "sharded export")
    _check_finite_everywhere(params, plan, group, bf16_dtype)
    sample = SqnrSample.of(sqnr)
    tally = _Tally(sample)
    values = _values(params, plan, group, bf16_dtype, backend, tally, sample is not None)
    inner = Export(
        {}, plan, values, bucket_bytes=bucket_bytes, step=step, sqnr=False, on_event=None,
        seconds=time.perf_counter() - t0,
    )  # fmt: skip
    return ShardedExport(inner, tally if sample is not None else None, tally)


def _check_finite_everywhere(params, plan: Plan, group, bf16_dtype: torch.dtype) -> None:
    """One flag per tensor (one aminmax pass each on the device, no host read per tensor; NaN
    propagates into both ends), all-reduced. A shard of a tensor the export casts to bf16_dtype
    has its ends cast too: a finite master past that dtype's range would be sent as Inf, and
    is refused as the single-process check refuses it (`mxrl.weights.finite.narrowed`)."""
    locals_ = {n: _local(params[n]) for n in plan}
    device = _device(params)
    zero = torch.zeros((), dtype=torch.int32, device=device)
    bad = torch.stack(
        [
            _not_finite(t, bf16_dtype if narrowed(n, plan[n], t, bf16_dtype) else None).to(
                device=device, dtype=torch.int32
            )
            if t.numel() > 0 and t.is_floating_point()
            else zero
            for n, t in locals_.items()
        ]
    )
    mine = bad.clone()
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if not bool(bad.any()):
        return
    names = [n for n, b in zip(locals_, bad.tolist(), strict=True) if b]
    held = [n for n, b in zip(locals_, mine.tolist(), strict=True) if b]
    if held:
        try:
            check_finite({n: locals_[n] for n in held}, plan, bf16_dtype=bf16_dtype)
        except ValueError as e:
            raise ValueError(
                f"{e} (indices are within rank {dist.get_rank(group)}'s shard: rows "
                "ceil(rows / ranks) * rank onwards of the whole tensor)"
            ) from None
    raise ValueError(
        f"refusing to export: master weight(s) {names[:5]} hold NaN/Inf, or values past "
        f"{bf16_dtype}'s range that the export would send as Inf (on another rank's shard; its "
        "log names the element). Nothing was sent: restore the last good checkpoint"
    )


def _not_finite(t: torch.Tensor, narrow_to: torch.dtype | None) -> torch.Tensor:
    ends = torch.stack(torch.aminmax(t))
    if narrow_to is not None:
        ends = ends.to(narrow_to)
    return ~torch.isfinite(ends).all()


def _values(params, plan: Plan, group, bf16_dtype, backend, tally, sqnr: bool) -> Iterator:
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    partners = fuse_partners(plan)
    chosen: dict[torch.device, Backend] = {}
    for name, spec in plan.items():
        p = params[name]
        shard = _local(p)
        if shard.device not in chosen:
            chosen[shard.device] = backend_for(backend, shard.device)
        be = chosen[shard.device]
        if _shard_local_ok(p, spec, world):
            value = _quantize_shard(shard, spec, params, partners, group, bf16_dtype, be)
            if sqnr and isinstance(value, QTensor):
                first = rank * -(-p.shape[0] // world)  # torch.chunk's rows per rank
                tally.meter.add(spec.layer, shard, value, first=first, total=p.shape[0])
            value = _gather_value(value, spec, world, group)
            tally.num_shard_local += 1
        else:
            whole = _full(p)
            if spec.format is Format.BF16:
                value = whole.to(bf16_dtype, copy=True).contiguous()
            else:
                partner = _full(params[partners[name]]) if name in partners else None
                value = _quantize(whole, spec, _amax(whole, spec, partner), be)
            if sqnr and isinstance(value, QTensor) and rank == 0:
                tally.meter.add(spec.layer, whole, value)  # counted once over the group
            tally.num_gathered += 1
        yield name, value
    if sqnr:
        tally.result = _reduce_sqnr(tally.meter, plan, group, _device(params))


def _shard_local_ok(p: torch.Tensor, spec: TensorSpec, world: int) -> bool:
    """Whether each rank can quantize its own rows exactly (the module docstring)."""
    if not isinstance(p, DTensor) or world == 1:
        return False  # whole on this rank: quantize it as it is
    if len(p.placements) != 1 or not p.placements[0].is_shard(0):
        return False
    rows = spec.shape[0]
    chunk = math.ceil(rows / world)
    if chunk * (world - 1) >= rows:
        return False  # some rank holds no row
    if spec.format is Format.FP8_BLOCK and len(spec.shape) == 2:
        block_rows = (spec.block or FP8_BLOCK_WEIGHT)[0]
        return chunk % block_rows == 0
    return True


def _quantize_shard(shard, spec, params, partners, group, bf16_dtype, backend) -> WeightValue:
    if spec.format is Format.BF16:
        return shard.to(bf16_dtype, copy=True).contiguous()
    partner = _local(params[partners[spec.name]]) if spec.name in partners else None
    amax = _amax(shard, spec, partner)
    if amax is not None and shard.dim() == 2:
        # a per-tensor scale: the whole tensor's (and its partner's) amax, before any byte
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return _quantize(shard, spec, amax, backend)


def _amax(w: torch.Tensor, spec: TensorSpec, partner: torch.Tensor | None):
    # every shard of every tensor was checked finite first (`_check_finite_everywhere`): the
    # one-read amax, the same values as the masked one
    return weight_amax(w, spec, partner, finite=True)


def _quantize(w: torch.Tensor, spec: TensorSpec, amax, backend: Backend) -> QTensor:
    block = spec.block or FP8_BLOCK_WEIGHT
    if spec.format is Format.FP8_BLOCK and block[1] not in KERNEL_FP8_BLOCK_SIZES:
        backend = Backend.REFERENCE
    kwargs: dict = {"check_finite": False}
    if spec.format is Format.NVFP4:
        kwargs["global_amax"] = amax  # finite: every shard was checked first
        kwargs["check_amax"] = False
    elif spec.format is Format.FP8_BLOCK:
        kwargs["block"] = spec.block
    return kernel_quantize(w.detach(), spec.format, **kwargs, backend=backend)


def _gather_value(value: WeightValue, spec: TensorSpec, world: int, group) -> WeightValue:
    """The whole tensor from every rank's rows of it (each field concatenated on dim 0)."""
    rows = spec.shape[0]
    if not isinstance(value, QTensor):
        return _gather_rows(value, rows, world, group)
    gs = value.global_scale
    if gs is not None and gs.dim() > 0:
        gs = _gather_rows(gs, rows, world, group)  # per expert (and half): rows of the tensor
    scale_rows = rows
    if value.fmt is Format.FP8_BLOCK and len(spec.shape) == 2:
        scale_rows = math.ceil(rows / (spec.block or FP8_BLOCK_WEIGHT)[0])
    return QTensor(
        qdata=_gather_rows(value.qdata, rows, world, group),
        scale=_gather_rows(value.scale, scale_rows, world, group),
        fmt=value.fmt,
        shape=torch.Size(spec.shape),
        axis=value.axis,
        global_scale=gs,
    )


def _gather_rows(t: torch.Tensor, rows: int, world: int, group) -> torch.Tensor:
    """All-gather dim-0 pieces in rank order (torch.chunk sizes: ceil(rows / world) each, the
    last shorter; every rank holds one), as uint8 (any dtype, on gloo and NCCL alike),
    trimmed to `rows`. A block FP8 scale's chunk is the shards' chunk / block rows: ceil nests."""
    chunk = math.ceil(rows / world)
    flat = t.contiguous().reshape(t.shape[0], -1).view(torch.uint8)
    padded = torch.zeros((chunk, flat.shape[1]), dtype=torch.uint8, device=t.device)
    padded[: flat.shape[0]].copy_(flat)
    out = torch.empty((world * chunk, flat.shape[1]), dtype=torch.uint8, device=t.device)
    dist.all_gather_into_tensor(out, padded, group=group)
    return out[:rows].view(t.dtype).reshape(rows, *t.shape[1:])


def _reduce_sqnr(meter: SqnrMeter, plan: Plan, group, device: torch.device) -> dict[str, float]:
    """Per-layer SQNR from the shards' sums. Keys come from the plan (the same on every rank);
    a rank that added nothing to a key (a gathered tensor counts on group rank 0 only) adds 0.
    SqnrMeter keeps float64 [signal, noise] sums per key: summed here over the group."""
    keys = sorted(
        {OTHER if s.layer is None else f"layer.{s.layer}" for s in plan.values()
         if s.format is not Format.BF16}
    )  # fmt: skip
    if not keys:
        return {}
    zero = torch.zeros(2, dtype=torch.float64, device=device)
    totals = meter.totals()
    stacked = torch.stack([totals.get(k, zero).to(device) for k in keys])
    dist.all_reduce(stacked, group=group)
    meter.set_totals(dict(zip(keys, stacked.unbind(0), strict=True)))
    return meter.result()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _device(params: dict[str, torch.Tensor]) -> torch.device:
    return _local(next(iter(params.values()))).device
