"""The one export path: master weights -> the bytes the rollout engine holds, with hashes.

`export_weights` is what the engine calls at construction, what live weight sync (mxrl.sync)
buckets and sends, and what checkpoint conversion writes to disk, so the three cannot disagree:
each tensor is quantized by `mxrl.recipe.quantize.quantize_weight` per its TensorSpec (bf16
tensors are cast to `bf16_dtype`), and carries a content hash the receiver recomputes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from mxrl.formats import QTensor
from mxrl.formats.constants import Format
from mxrl.formats.numerics import tensor_bytes
from mxrl.models.adapter import hf_location
from mxrl.recipe import Plan

WeightValue = QTensor | torch.Tensor


@dataclass(frozen=True)
class WeightRecord:
    """One exported tensor: its plan name, its value (QTensor when quantized) and content hash."""

    name: str
    value: WeightValue
    hash: str

    @property
    def nbytes(self) -> int:
        v = self.value
        return v.nbytes if isinstance(v, QTensor) else v.numel() * v.element_size()


def content_hash(value: WeightValue) -> str:
    """sha256 over format, shape, dtypes and every stored byte (QTensor fields in order)."""
    h = hashlib.sha256()
    if isinstance(value, QTensor):
        h.update(f"qtensor|{value.fmt}|{tuple(value.shape)}|{value.axis}|".encode())
        for name, t in value.tensors().items():
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(tensor_bytes(t))
    else:
        h.update(f"tensor|{value.dtype}|{tuple(value.shape)}|".encode())
        h.update(tensor_bytes(value))
    return h.hexdigest()


def check_finite(named_tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse master weights holding NaN/Inf, naming every such tensor and its first bad element
    where a per-expert HF checkpoint keeps it (before anything is quantized or sent)."""
    bad = []
    for name, t in named_tensors.items():
        if not t.is_floating_point() or t.numel() == 0:
            continue
        lo, hi = torch.aminmax(t.detach())  # one pass; NaN propagates into both
        if bool(torch.isfinite(lo) & torch.isfinite(hi)):
            continue
        finite = torch.isfinite(t.detach())
        if not bool(finite.all()):
            count = int((~finite).sum())
            first = tuple(
                int(i) for i in torch.unravel_index((~finite).reshape(-1).nonzero()[0], t.shape)
            )
            value = float(t.detach()[first])
            where = hf_location(name, first, tuple(t.shape))
            bad.append(f"{name}: {count} non-finite, first {where} = {value}")
    if bad:
        raise ValueError(
            f"refusing to export: {len(bad)} master weight(s) hold NaN/Inf: {'; '.join(bad[:5])}. "
            "Nothing was sent. After an optimizer step this means the step diverged: restore "
            "the last good checkpoint; right after loading a model, its checkpoint holds them."
        )


def export_weights(
    named_params: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    plan: Plan,
    *,
    bf16_dtype: torch.dtype = torch.bfloat16,
) -> Iterator[WeightRecord]:
    """Quantize every tensor of the plan from the master weights, in plan order.

    All tensors are checked for NaN/Inf first (`check_finite`), so an error comes before the first
    record. Raises ValueError for a tensor the plan names that is missing, or the reverse.
    """
    from mxrl.recipe.quantize import quantize_weight

    params = dict(named_params.items() if isinstance(named_params, Mapping) else named_params)
    missing = [n for n in plan if n not in params]
    extra = [n for n in params if n not in plan]
    if missing or extra:
        raise ValueError(
            f"export: the plan ({plan.hash()[:12]}) and the weights disagree: missing "
            f"{missing[:3]} ({len(missing)}), not in the plan {extra[:3]} ({len(extra)}); "
            "resolve the plan against this model"
        )
    check_finite(params)
    partners = _fuse_partners(plan)
    for name, spec in plan.items():
        w = params[name].detach()
        if spec.format is Format.BF16:
            value: WeightValue = w.to(bf16_dtype, copy=True).contiguous()  # never aliased
        else:
            partner = params[partners[name]].detach() if name in partners else None
            value = quantize_weight(w, spec, partner)
        yield WeightRecord(name, value, content_hash(value))


def _fuse_partners(plan: Plan) -> dict[str, str]:
    """gate <-> up names of 2-D fuse groups (a fused 3-D gate_up tensor is its own group)."""
    groups: dict[str, list[str]] = {}
    for name, spec in plan.items():
        if spec.fuse_group is not None and spec.fuse_group != name:
            groups.setdefault(spec.fuse_group, []).append(name)
    out = {}
    for members in groups.values():
        if len(members) == 2:
            out[members[0]], out[members[1]] = members[1], members[0]
    return out
