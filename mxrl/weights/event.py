"""QuantizationEvent: the record of one export, with the per-layer SQNR measured while exporting.

SQNR (dB) per layer, against the master weights, summed in float64 on the master's device (no
second quantization pass, one host read per export): 10*log10(sum master^2 / sum (master -
dequantize(q))^2) over the quantized tensors of a layer ("layer.{i}"), and of the tensors outside
the decoder stack ("other"). Tensors the plan keeps in bf16 are not counted: a layer without a
quantized tensor has no key.

A `SqnrSample` measures a share of every 3-D expert stack: one of `stride` contiguous groups
of its experts, the group its phase names (2-D tensors always whole). The GRPO loop exports
every step with stride 16 and the phase moving with the step, so each expert is measured once
every 16 steps and the measurement reads 1/16 of the expert bytes it would read whole: the SQNR is a
second read of every master weight beside the export's own, and at full size it cost the loop's
sync as much as the quantization itself (docs/sync.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mxrl.formats import QTensor
from mxrl.kernels import error_sums
from mxrl.weights.host import HostCopy

OTHER = "other"  # sqnr_db key of tensors without a decoder layer (embedding, lm_head)
_SQNR_ELEMENTS = 1 << 24  # elements dequantized at once (3-D tensors: whole experts)


@dataclass(frozen=True)
class QuantizationEvent:
    """One export of the master weights (docs/design.md §1: traceable records of every quantization).

    num_bytes: bytes of every record (quantized data, scales, global scales, bf16 tensors).
    seconds: time spent quantizing, checksumming and measuring (not in the buckets' consumer).
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
class SqnrSample:
    """Which experts of a 3-D expert stack [E, N, K] the SQNR measures: split into
    s = min(stride, E) contiguous groups (expert e in group floor(e * s / E)), group
    phase mod s. Contiguous, so the measured experts are a view of the stack, not a copy; a
    stack of fewer experts than the stride still has one measured. stride 1: every expert."""

    stride: int = 1
    phase: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.stride, int) or isinstance(self.stride, bool) or self.stride < 1:
            raise ValueError(f"SqnrSample.stride must be an int >= 1, got {self.stride!r}")
        if not isinstance(self.phase, int) or isinstance(self.phase, bool) or self.phase < 0:
            raise ValueError(f"SqnrSample.phase must be an int >= 0, got {self.phase!r}")

    @classmethod
    def at_step(cls, step: int, stride: int) -> SqnrSample:
        """The loop's sample at `step`: the phase moves by one group each step."""
        return cls(stride, step % stride)

    @classmethod
    def of(cls, sqnr: bool | SqnrSample) -> SqnrSample | None:
        """An export's `sqnr` argument as a sample: True every expert, False None (off)."""
        if isinstance(sqnr, SqnrSample):
            return sqnr
        return cls() if sqnr else None

    def experts(self, first: int, count: int, total: int) -> list[int] | None:
        """The measured experts among global indices first..first+count-1 of a stack of
        `total`, as indices into that range; None: all of them."""
        s = min(self.stride, total)
        if s <= 1:
            return None
        group = self.phase % s
        return [i for i in range(count) if (first + i) * s // total == group]


class SqnrMeter:
    """Per-layer sums of master^2 and error^2, kept on their device until `result()` reads them
    all at once and adds them per layer on the host, in the order they were added. Each added
    tensor is either its float64 [2] sums (`error_sums`: float64 additions on the host round
    as on the device) or the fp32 parts its quantizer summed over its tiles while quantizing
    (`mxrl.kernels.quantize_measured`: no second read of the master), added in float64 on the
    host. `queue()` starts the copies to the host; `result()` reads them."""

    def __init__(self, sample: SqnrSample | None = None) -> None:
        # (key, float64 [signal, noise]) or (key, fp32 parts [n, 2], one (signal, noise) a row)
        self._parts: list[tuple[str, torch.Tensor]] = []
        self.sample = SqnrSample() if sample is None else sample
        self._copies: tuple[HostCopy | None, HostCopy | None] | None = None

    def add(
        self,
        layer: int | None,
        master: torch.Tensor,
        q: QTensor,
        *,
        first: int = 0,
        total: int | None = None,
        parts: torch.Tensor | None = None,
    ) -> None:
        """Add a quantized tensor's sums to its layer's. An expert stack (3-D, blocks along the
        last dim) counts the sample's experts only; `first` / `total`: a shard's first expert
        and the whole stack's count (default: the tensor is the whole stack). parts: the sums
        its quantizer kept ([G, P, 3], `quantize_measured`), taken instead of reading the
        master again; with a sample, only where they are per expert (G = E)."""
        self._copies = None  # a result() after this add queues its copies again
        key = OTHER if layer is None else f"layer.{layer}"
        if master.dim() == 3 and q.axis in (-1, 2):
            count = master.shape[0]
            idx = self.sample.experts(first, count, count if total is None else total)
            if idx is not None:
                if not idx:
                    return  # none of this shard's experts is in the sample
                start, stop = idx[0], idx[-1] + 1  # contiguous: views, no copy
                master, q = master[start:stop], _experts(q, start, stop)
                per_expert = parts is not None and parts.shape[0] == count
                parts = parts[start:stop] if per_expert else None
        if parts is not None:  # (signal, noise) of each part; its third column is the check's
            self._parts.append((key, parts.reshape(-1, parts.shape[-1])[:, :2]))
        else:
            self._parts.append((key, _squared_sums(master, q)))

    def totals(self) -> dict[str, torch.Tensor]:
        """Each key's float64 [signal, noise], summed on the device in the order added (what
        the sharded export all-reduces over its ranks)."""
        out: dict[str, torch.Tensor] = {}
        for key, sums in self._parts:
            if sums.dtype != torch.float64:  # a quantizer's fp32 parts
                sums = sums.sum(0, dtype=torch.float64)
            out[key] = out[key] + sums if key in out else sums
        return out

    def set_totals(self, totals: Mapping[str, torch.Tensor]) -> None:
        """Replace what was added by these per-key sums (the sharded export's reduced ones)."""
        self._parts, self._copies = list(totals.items()), None

    def queue(self) -> None:
        """Start the copies `result()` reads (once every tensor is added): one for the float64
        sums, one for the quantizers' parts; each a launch, none a wait."""
        if self._copies is not None:
            return
        sums = [s for _, s in self._parts if s.dtype == torch.float64]
        parts = [p for _, p in self._parts if p.dtype != torch.float64]
        device = self._parts[0][1].device if self._parts else None
        self._copies = (
            HostCopy(torch.stack([s.to(device) for s in sums])) if sums else None,
            HostCopy(torch.cat([p.to(device) for p in parts])) if parts else None,
        )

    def result(self) -> dict[str, float]:
        def order(key: str) -> tuple[int, int]:
            return (1, 0) if key == OTHER else (0, int(key.split(".")[1]))

        if not self._parts:
            return {}
        self.queue()
        sums_copy, parts_copy = self._copies
        sums = iter(sums_copy.read().tolist() if sums_copy is not None else [])
        flat = parts_copy.read().to(torch.float64) if parts_copy is not None else None
        sizes = [p.shape[0] for _, p in self._parts if p.dtype != torch.float64]
        measured = iter(flat.split(sizes) if flat is not None else [])
        by_key: dict[str, list[float]] = {}
        for key, held in self._parts:
            s, n = next(sums) if held.dtype == torch.float64 else next(measured).sum(0).tolist()
            if key in by_key:
                by_key[key][0] += s
                by_key[key][1] += n
            else:
                by_key[key] = [s, n]
        out = {}
        for key in sorted(by_key, key=order):
            s, n = by_key[key]
            out[key] = math.inf if n == 0.0 else (-math.inf if s == 0.0 else 10 * math.log10(s / n))
        return out


@torch.no_grad()
def _squared_sums(master: torch.Tensor, q: QTensor) -> torch.Tensor:
    """float64 [sum master^2, sum (master - dequantize(q))^2], on the master's device; a 3-D
    tensor a group of whole experts at a time (bounded temporary memory)."""
    master = master.detach() if master.requires_grad else master
    if master.dim() == 3 and q.axis in (-1, 2):
        count = master.shape[0]
        step = max(1, _SQNR_ELEMENTS // max(1, math.prod(master.shape[1:])))
        if step >= count:  # one group: its sums as they are (0 + x is x: no launch for it)
            return error_sums(q, master)
        total = torch.zeros(2, dtype=torch.float64, device=master.device)
        for start in range(0, count, step):
            stop = min(start + step, count)
            total += error_sums(_experts(q, start, stop), master[start:stop])
        return total
    return error_sums(q, master)  # the device's default: one fused pass on a GPU


def _experts(q: QTensor, start: int, stop: int) -> QTensor:
    """Experts start..stop-1 of a 3-D QTensor (every field is batched over dim 0)."""
    gs = q.global_scale
    if gs is not None and gs.dim() > 0:
        gs = gs[start:stop]
    shape = (stop - start, *q.shape[1:])
    return QTensor(q.qdata[start:stop], q.scale[start:stop], q.fmt, shape, q.axis, gs)
