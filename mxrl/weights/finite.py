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
from mxrl.arch.names import keeps_fp32
from mxrl.formats import QTensor
from mxrl.formats.constants import Format
from mxrl.recipe import Plan
from mxrl.recipe.quantize import own_weight_amax
from mxrl.weights.host import HostCopy
from mxrl.weights.record import WeightValue

# FiniteCheck's probes, in their flags' order
GROUPS = ("floats", "vectors", "codes", "counts", "narrowed")


def detached(t: torch.Tensor) -> torch.Tensor:
    """`t.detach()` where autograd tracks t; t itself otherwise (already detached: the same
    values and storage, one dispatch fewer per tensor on every sync)."""
    return t.detach() if t.requires_grad else t


class FiniteCheck:
    """`check_finite(named_tensors, plan)` queued: every probe (an aminmax, or an NVFP4
    tensor's global amaxes, kept in `amaxes`) on its device's current stream; `result()` reads
    the flags once, raises naming every bad tensor, and returns `amaxes`. Work on another
    stream that reads `amaxes` calls `ready` on that stream first.

    on_values=True reads only the NVFP4 tensors now (their amaxes, which their quantizers
    take); every other tensor is checked on the value it exports, handed to `add` before
    `result()`: its bf16 (or fp32) copy, or the E4M3 codes of an MXFP8 or block-FP8 value,
    where a non-finite element, and nothing else, is the byte 0x7F (docs/formats.md,
    "Non-finite inputs"). That reads 1 or 2 bytes an element where the master holds 4, and
    the verdict is the same, but for a finite master past bf16's range, whose bf16 copy is
    not finite and is refused too. The export uses it when the update is one bucket, where
    every value exists before anything is sent.

    bf16_dtype: what the plan's bf16 tensors are exported as; on the masters (on_values=False)
    such a tensor's min and max are also cast to it, so that a finite master past its range,
    which the export would send as Inf, is refused as the check of the values refuses it."""

    def __init__(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        plan: Plan | None = None,
        *,
        on_values: bool = False,
        bf16_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self._masters = {
            name: detached(t)
            for name, t in named_tensors.items()
            if t.is_floating_point() and t.numel()
        }
        self.on_values = on_values
        self.bf16_dtype = bf16_dtype
        self.amaxes: dict[str, torch.Tensor] = {}
        # each tensor's probes on its device, one op per group and device for all of them: no
        # launch per tensor but its read. floats: 0-d mins and maxes, stacked at once; vectors:
        # global amaxes; codes: an E4M3 value's largest byte as int8 (0x7F: a non-finite input);
        # counts: the largest of its quantizer's non-finite counts (`quantize_measured`);
        # narrowed: the min and max of a master exported as bf16_dtype, cast to it
        self._groups: dict[torch.device, dict[str, list[torch.Tensor]]] = {}
        self._spans: dict[str, tuple[torch.device, str, int, int]] = {}
        self._amax_ready: dict[torch.device, torch.cuda.Event] = {}
        self._ready_on: set[torch.cuda.Stream] = set()  # streams that waited for them
        self._values: dict[str, WeightValue] = {}  # what add() checked, for the message
        for name, t in self._masters.items():
            spec = plan.get(name) if plan is not None else None
            if spec is not None and spec.format is Format.NVFP4 and tuple(t.shape) == spec.shape:
                # the infinity norm propagates NaN (ATen's AbsMaxOps reduce with
                # max_propagate_nan) and |±Inf| = Inf: this read is the check and the global amax
                amax = own_weight_amax(t, spec, finite=True)
                self.amaxes[name] = amax
                self._probe(name, "vectors", [amax.reshape(-1)])
            elif not on_values:
                cast = spec is not None and narrowed(name, spec, t, bf16_dtype)
                self._probe(name, "narrowed" if cast else "floats", list(torch.aminmax(t)))
        for device in {a.device for a in self.amaxes.values() if a.device.type == "cuda"}:
            self._amax_ready[device] = torch.cuda.Event()
            self._amax_ready[device].record(torch.cuda.current_stream(device))
        self._flags: dict[torch.device, HostCopy] = {}
        self._verdict: list[str] | None = None
        if not on_values:
            self._queue_flags()

    def _probe(self, name: str, group: str, probes: list[torch.Tensor]) -> None:
        device = probes[0].device
        held = self._groups.setdefault(device, {g: [] for g in GROUPS})[group]
        start = sum(p.numel() for p in held)
        held.extend(probes)
        self._spans[name] = (device, group, start, start + sum(p.numel() for p in probes))

    def add(self, name: str, value: WeightValue, parts: torch.Tensor | None = None) -> None:
        """Queue the check of `name` on the value it exports (on_values; an NVFP4 value is
        checked by its master's amaxes already; an empty master, and so its value, by none).
        parts: what its quantizer counted while reading the master ([..., 3], the third
        column its non-finite elements, `quantize_measured`): the check reads those counts
        instead of the value's codes."""
        assert self.on_values and not self._flags, "add() takes values before result()"
        if name in self.amaxes or name not in self._masters:
            return
        if isinstance(value, QTensor):
            if value.fmt not in (Format.MXFP8, Format.FP8_BLOCK):
                raise ValueError(f"{name}: a {value.fmt} value is checked on its master")
            if parts is not None:
                self._probe(name, "counts", [parts[..., 2].amax()])
            else:
                self._probe(name, "codes", [value.qdata.view(torch.int8).amax()])
        else:
            self._probe(name, "floats", list(torch.aminmax(value)))
        self._values[name] = value

    def _queue_flags(self) -> None:
        """Per device, one flag per probe value, copied to pinned host memory behind an event."""
        for device, groups in self._groups.items():
            # the mins and maxes stacked, then one cat with the amaxes and one isfinite: on the
            # probes' stream, or the values' (`quantized_values` made it wait for the amaxes)
            finite = ([torch.stack(groups["floats"])] if groups["floats"] else []) + groups[
                "vectors"
            ]
            parts = [torch.isfinite(torch.cat(finite))] if finite else []
            if groups["codes"]:
                parts.append(torch.stack(groups["codes"]) != 0x7F)
            if groups["counts"]:
                parts.append(torch.stack(groups["counts"]) == 0)
            if groups["narrowed"]:  # the extremes cast as the export casts the tensor
                parts.append(torch.isfinite(torch.stack(groups["narrowed"]).to(self.bf16_dtype)))
            flags = torch.cat(parts) if len(parts) > 1 else parts[0]
            self._flags[device] = HostCopy(flags)

    def _exported(self, name: str, group: str) -> WeightValue | None:
        """What a refused tensor exports, for its message: the value `add` checked, or the
        master cast to bf16_dtype (a narrowed one: only on the error path)."""
        if group == "narrowed":
            return self._masters[name].to(self.bf16_dtype)
        return self._values.get(name)

    def ready(self, device: torch.device) -> None:
        """Order the current stream of `device` after the amaxes' reads (a quantizer about to
        read `amaxes` there), and keep their memory until that stream is done with them."""
        event = self._amax_ready.get(device)
        if event is None:
            return
        stream = torch.cuda.current_stream(device)
        if stream in self._ready_on:  # ordered already: once per stream, not per quantizer
            return
        self._ready_on.add(stream)
        stream.wait_event(event)
        for amax in self.amaxes.values():
            if amax.device == device:
                amax.record_stream(stream)

    def result(self) -> dict[str, torch.Tensor]:
        """The NVFP4 tensors' global amaxes by name, once every flag is read; raises ValueError
        naming every tensor holding NaN/Inf (its count, first element and value). Reading
        again gives the same verdict without waiting."""
        if self._verdict is None:
            if not self._flags and self._groups:
                self._queue_flags()
            host = {device: flags.read().tolist() for device, flags in self._flags.items()}
            offsets = {  # where each group starts in its device's flags (in GROUPS order)
                device: {g: sum(p.numel() for h in GROUPS[:i] for p in groups[h])
                         for i, g in enumerate(GROUPS)}
                for device, groups in self._groups.items()
            }  # fmt: skip
            self._verdict = [
                _describe(name, self._masters[name], self._exported(name, group))
                for name, (device, group, a, b) in self._spans.items()
                if not all(host[device][offsets[device][group] + a : offsets[device][group] + b])
            ]
        if self._verdict:
            bad = self._verdict
            raise ValueError(
                f"refusing to export: {len(bad)} master weight(s) hold NaN/Inf: "
                f"{'; '.join(bad[:5])}. Nothing was sent. After an optimizer step this means "
                "the step diverged: restore the last good checkpoint; right after loading a "
                "model, its checkpoint holds them."
            )
        return self.amaxes


def _describe(name: str, master: torch.Tensor, value: WeightValue | None = None) -> str:
    """'name: count non-finite, first <where a per-expert HF checkpoint keeps it> = value', of
    the master; of its exported `value` where the master is finite (past bf16's range)."""
    finite = torch.isfinite(master)
    exported = bool(finite.all()) and isinstance(value, torch.Tensor)
    bad = ~torch.isfinite(value) if exported else ~finite
    first = tuple(int(i) for i in torch.unravel_index(bad.reshape(-1).nonzero()[0], bad.shape))
    where = hf_location(name, first, tuple(bad.shape))
    if exported:
        return (
            f"{name}: finite, but {int(bad.sum())} value(s) past {value.dtype}'s range, which "
            f"it exports as non-finite, first {where} = {float(master[first])}"
        )
    return f"{name}: {int(bad.sum())} non-finite, first {where} = {float(master[first])}"


def narrowed(name: str, spec, master: torch.Tensor, bf16_dtype: torch.dtype) -> bool:
    """Whether the export casts `master` to a narrower float (a bf16 tensor of the plan, not
    one kept in fp32, held wider than bf16_dtype)."""
    if spec.format is not Format.BF16 or keeps_fp32(name):
        return False
    return torch.finfo(master.dtype).max > torch.finfo(bf16_dtype).max


def check_finite(
    named_tensors: Mapping[str, torch.Tensor],
    plan: Plan | None = None,
    *,
    bf16_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """Refuse master weights holding NaN/Inf, naming every such tensor and its first bad element
    where a per-expert HF checkpoint keeps it (before anything is quantized or sent). One read
    per tensor and one host read for all of them (`FiniteCheck`, read at once). With a plan,
    the global amaxes of the tensors it makes NVFP4 are returned by name for the quantizer
    (`quantized_values`): the check and the global amax are one read, not two. A tensor the
    plan exports as bf16 (as `bf16_dtype`) is refused too where a finite value is past that
    dtype's range (it would be sent as Inf)."""
    return FiniteCheck(named_tensors, plan, bf16_dtype=bf16_dtype).result()
