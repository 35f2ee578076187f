"""The export's NaN/Inf check of the master weights: one read per tensor, one host read for all.

    amaxes = check_finite(params, plan)       # raises now, naming every bad tensor
    check = FiniteCheck(params, plan)          # queued: the host goes on at once
    ... quantize with check.amaxes ...         # check.ready(device) first, on that stream
    check.result()                             # raises as check_finite does, or the amaxes

A tensor the plan makes NVFP4 is read for its own global amax(es) (`own_weight_amax`, the
infinity norm: NaN and Inf propagate, so they are all finite exactly when the tensor is), which
the quantizer takes (`quantized_values`): the check and the global amax are one read. Any other
tensor is read by one aminmax. `FiniteCheck` queues those reads and the flags' copy to the host
behind an event, so that an export can queue its quantizers before it knows the verdict, and
read it where it reads its checksums anyway (`mxrl.weights.buckets`): before the first bucket
exists, so before anything is sent.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mxrl.arch.experts import hf_location
from mxrl.formats.constants import Format
from mxrl.recipe import Plan
from mxrl.recipe.quantize import own_weight_amax


def detached(t: torch.Tensor) -> torch.Tensor:
    """`t.detach()` where autograd tracks t; t itself otherwise (already detached: the same
    values and storage, one dispatch fewer per tensor on every sync)."""
    return t.detach() if t.requires_grad else t


class FiniteCheck:
    """`check_finite(named_tensors, plan)` queued: every probe (an aminmax, or an NVFP4
    tensor's global amaxes, kept in `amaxes`) and the flags' copy to pinned host memory are on
    their device's current stream; `result()` reads the flags once, raises naming every bad
    tensor, and returns `amaxes`. Work on another stream that reads `amaxes` calls `ready` on
    that stream first."""

    def __init__(self, named_tensors: Mapping[str, torch.Tensor], plan: Plan | None = None) -> None:
        self._checked = [
            (name, detached(t))
            for name, t in named_tensors.items()
            if t.is_floating_point() and t.numel()
        ]
        self.amaxes: dict[str, torch.Tensor] = {}
        # each tensor's probe values (its min and max, or its global amaxes) on its device, one
        # isfinite per device for all of them: no launch per tensor but its read. The 0-d mins
        # and maxes are stacked at once (one op, not a view each), ahead of the amaxes.
        scalars: dict[torch.device, list[torch.Tensor]] = {}
        vectors: dict[torch.device, list[torch.Tensor]] = {}
        sizes: dict[torch.device, int] = {}  # elements in vectors
        spans = []  # (device, True: in scalars / False: in vectors, start, stop)
        for name, t in self._checked:
            spec = plan.get(name) if plan is not None else None
            if spec is not None and spec.format is Format.NVFP4 and tuple(t.shape) == spec.shape:
                # the infinity norm propagates NaN (ATen's AbsMaxOps reduce with
                # max_propagate_nan) and |±Inf| = Inf: this read is the check and the global amax
                amax = own_weight_amax(t, spec, finite=True)
                self.amaxes[name] = amax
                vectors.setdefault(t.device, []).append(amax.reshape(-1))
                start = sizes.get(t.device, 0)
                sizes[t.device] = start + amax.numel()
                spans.append((t.device, False, start, sizes[t.device]))
            else:
                held = scalars.setdefault(t.device, [])
                spans.append((t.device, True, len(held), len(held) + 2))
                held.extend(torch.aminmax(t))  # one pass; NaN goes into both
        base = {device: len(held) for device, held in scalars.items()}  # where amaxes start
        self._spans = [  # (device, start, stop) in that device's flags
            (d, a + (0 if lone else base.get(d, 0)), b + (0 if lone else base.get(d, 0)))
            for d, lone, a, b in spans
        ]
        self._flags: dict[torch.device, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        for device in dict.fromkeys(d for d, _, _ in self._spans):
            probe = [torch.stack(scalars[device])] if device in scalars else []
            flags = torch.isfinite(torch.cat(probe + vectors.get(device, [])))
            event = None
            if device.type == "cuda":
                host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
                host.copy_(flags, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                flags = host
            self._flags[device] = (flags, event)
        self._verdict: list[str] | None = None

    def ready(self, device: torch.device) -> None:
        """Order the current stream of `device` after the probes (a quantizer about to read
        `amaxes` there), and keep the amaxes' memory until that stream is done with them."""
        found = self._flags.get(device)
        if found is None or found[1] is None:
            return
        stream = torch.cuda.current_stream(device)
        stream.wait_event(found[1])
        for amax in self.amaxes.values():
            if amax.device == device:
                amax.record_stream(stream)

    def result(self) -> dict[str, torch.Tensor]:
        """The NVFP4 tensors' global amaxes by name, once every flag is read; raises ValueError
        naming every tensor holding NaN/Inf (its count, first element and value). Reading
        again gives the same verdict without waiting."""
        if self._verdict is None:
            host = {}
            for device, (flags, event) in self._flags.items():
                if event is not None:
                    event.synchronize()
                host[device] = flags.tolist()
            finite = [all(host[d][a:b]) for d, a, b in self._spans]
            self._verdict = [
                _describe(name, t) for (name, t), ok in zip(self._checked, finite, strict=True)
                if not ok
            ]  # fmt: skip
        if self._verdict:
            bad = self._verdict
            raise ValueError(
                f"refusing to export: {len(bad)} master weight(s) hold NaN/Inf: "
                f"{'; '.join(bad[:5])}. Nothing was sent. After an optimizer step this means "
                "the step diverged: restore the last good checkpoint; right after loading a "
                "model, its checkpoint holds them."
            )
        return self.amaxes


def _describe(name: str, t: torch.Tensor) -> str:
    """'name: count non-finite, first <where a per-expert HF checkpoint keeps it> = value'."""
    finite = torch.isfinite(t)
    count = int((~finite).sum())
    first = tuple(int(i) for i in torch.unravel_index((~finite).reshape(-1).nonzero()[0], t.shape))
    where = hf_location(name, first, tuple(t.shape))
    return f"{name}: {count} non-finite, first {where} = {float(t[first])}"


def check_finite(
    named_tensors: Mapping[str, torch.Tensor], plan: Plan | None = None
) -> dict[str, torch.Tensor]:
    """Refuse master weights holding NaN/Inf, naming every such tensor and its first bad element
    where a per-expert HF checkpoint keeps it (before anything is quantized or sent). One read
    per tensor and one host read for all of them (`FiniteCheck`, read at once). With a plan,
    the global amaxes of the tensors it makes NVFP4 are returned by name for the quantizer
    (`quantized_values`): the check and the global amax are one read, not two."""
    return FiniteCheck(named_tensors, plan).result()
