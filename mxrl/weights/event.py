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
    """Per-layer sums of master^2 and error^2, kept on the device until `result()`."""

    def __init__(self, sample: SqnrSample | None = None) -> None:
        self._sums: dict[str, torch.Tensor] = {}  # key -> float64 [2] (signal, noise)
        self.sample = SqnrSample() if sample is None else sample

    def add(
        self,
        layer: int | None,
        master: torch.Tensor,
        q: QTensor,
        *,
        first: int = 0,
        total: int | None = None,
    ) -> None:
        """Add a quantized tensor's sums to its layer's. An expert stack (3-D, blocks along the
        last dim) counts the sample's experts only; `first` / `total`: a shard's first expert
        and the whole stack's count (default: the tensor is the whole stack)."""
        key = OTHER if layer is None else f"layer.{layer}"
        if master.dim() == 3 and q.axis in (-1, 2):
            count = master.shape[0]
            idx = self.sample.experts(first, count, count if total is None else total)
            if idx is not None:
                if not idx:
                    return  # none of this shard's experts is in the sample
                start, stop = idx[0], idx[-1] + 1  # contiguous: views, no copy
                master, q = master[start:stop], _experts(q, start, stop)
        sums = _squared_sums(master, q)
        self._sums[key] = self._sums[key] + sums if key in self._sums else sums

    def result(self) -> dict[str, float]:
        def order(key: str) -> tuple[int, int]:
            return (1, 0) if key == OTHER else (0, int(key.split(".")[1]))

        keys = sorted(self._sums, key=order)
        if not keys:
            return {}
        device = next(iter(self._sums.values())).device
        host = torch.stack([s.to(device) for s in self._sums.values()]).tolist()  # one read
        by_key = dict(zip(self._sums, host, strict=True))
        out = {}
        for key in keys:
            s, n = by_key[key]
            out[key] = math.inf if n == 0.0 else (-math.inf if s == 0.0 else 10 * math.log10(s / n))
        return out


@torch.no_grad()
def _squared_sums(master: torch.Tensor, q: QTensor) -> torch.Tensor:
    """float64 [sum master^2, sum (master - dequantize(q))^2], on the master's device; a 3-D
    tensor a group of whole experts at a time (bounded temporary memory)."""
    master = master.detach()
    if master.dim() == 3 and q.axis in (-1, 2):
        step = max(1, _SQNR_ELEMENTS // max(1, master[0].numel()))
        total = torch.zeros(2, dtype=torch.float64, device=master.device)
        for start in range(0, master.shape[0], step):
            stop = min(start + step, master.shape[0])
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
