"""The one export path: master weights -> the bytes the rollout engine holds, with checksums.

`export_weights` is what the engine calls at construction, what live weight sync buckets and
sends (`mxrl.weights.export`), and what checkpoint conversion writes to disk, so the three cannot
disagree: each tensor is quantized per its TensorSpec on the master's device (bf16 tensors are
cast to `bf16_dtype`), and carries a checksum the receiver recomputes.

Quantizer: `mxrl.kernels.quantize` on `backend` (default: chosen once for the master's device,
Triton on CUDA), byte-exact with the reference quantizer `mxrl.recipe.quantize.quantize_weight`
uses; a spec the kernels do not take (a block FP8 block size outside theirs) takes the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping

import torch

from mxrl.arch.names import keeps_fp32
from mxrl.formats.constants import FP8_BLOCK_WEIGHT, Format
from mxrl.kernels import Backend, Kernels, quantize_measured
from mxrl.kernels import quantize as kernel_quantize
from mxrl.kernels.api import KERNEL_FP8_BLOCK_SIZES
from mxrl.kernels.backend import backend_for
from mxrl.recipe import Plan, TensorSpec
from mxrl.recipe.quantize import weight_layout, weight_quantizer_kwargs
from mxrl.weights.digest import checksum
from mxrl.weights.finite import FiniteCheck, check_finite, detached
from mxrl.weights.record import WeightRecord, WeightValue


def check_names(params: Mapping[str, torch.Tensor], plan: Plan, what: str = "export") -> None:
    """Refuse weights whose names are not exactly the plan's (before anything is quantized)."""
    missing = [n for n in plan if n not in params]
    extra = [n for n in params if n not in plan]
    if missing or extra:
        raise ValueError(
            f"{what}: the plan ({plan.hash()[:12]}) and the weights disagree: missing "
            f"{missing[:3]} ({len(missing)}), not in the plan {extra[:3]} ({len(extra)}); "
            "resolve the plan against this model"
        )


@functools.lru_cache(maxsize=1 << 14)
def spec_layout(spec: TensorSpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """`weight_layout(spec)`, derived once per spec (a frozen, hashed TensorSpec: another plan's
    spec is another key). The dict is shared: read it, never change it."""
    return weight_layout(spec)


def quantized_values(
    named_params: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    plan: Plan,
    *,
    bf16_dtype: torch.dtype = torch.bfloat16,
    backend: Kernels | Backend | str | None = None,
    check: FiniteCheck | None = None,
    sums: dict[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, WeightValue]]:
    """(name, value) of every tensor of the plan, in plan order, quantized on the master's
    device; checksums are the caller's (`export_weights` one by one, buckets one per bucket).

    All tensors are checked for NaN/Inf first (`check_finite`), so an error comes before the
    first value. Raises ValueError for a tensor the plan names that is missing, or the reverse.
    Each master is read once by the check and once by its quantizer (an NVFP4 tensor's global
    amax is the check's read). check: that check already queued over these tensors
    (`FiniteCheck(params, plan)`), whose verdict the caller reads before it hands out any
    value (`mxrl.weights.buckets`): the values are quantized without waiting for it.
    """
    items = named_params.items() if isinstance(named_params, Mapping) else named_params
    params = {name: detached(t) for name, t in items}  # once: the check and the quantizer
    check_names(params, plan)
    amaxes = check_finite(params, plan, bf16_dtype=bf16_dtype) if check is None else check.amaxes
    partners = fuse_partners(plan)
    chosen: dict[torch.device, Backend] = {}
    for name, spec in plan.items():
        w = params[name]
        if spec.format is Format.BF16:
            # one copy, contiguous whatever the master's strides, never aliased
            # the fp32 tensors (DeepSeek's router bias) stay fp32 (mxrl.arch.names.keeps_fp32)
            dtype = torch.float32 if keeps_fp32(name) else bf16_dtype
            value: WeightValue = w.to(dtype, copy=True, memory_format=torch.contiguous_format)
        else:
            if w.device not in chosen:  # once per device
                chosen[w.device] = backend_for(backend, w.device)
            partner = partners.get(name)
            if check is not None and name in amaxes:
                check.ready(w.device)  # its amaxes are queued, maybe on another stream
            amax = _global_amax(name, w, partner, amaxes)
            partner_w = params[partner] if partner is not None else None
            value, parts = _quantize(w, spec, partner_w, amax, chosen[w.device], sums is not None)
            if parts is not None:
                sums[name] = parts
            # the layout every receiver checks records against (mxrl.weights.check)
            assert value.layout() == spec_layout(spec), (name, value.layout())
        yield name, value


def export_weights(
    named_params: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    plan: Plan,
    *,
    bf16_dtype: torch.dtype = torch.bfloat16,
    backend: Kernels | Backend | str | None = None,
) -> Iterator[WeightRecord]:
    """Quantize every tensor of the plan from the master weights, in plan order, each record
    with its checksum (`quantized_values` says what is checked first)."""
    for name, value in quantized_values(named_params, plan, bf16_dtype=bf16_dtype, backend=backend):
        yield WeightRecord(name, value, checksum(name, value))


def quantize_tensor(
    w: torch.Tensor, spec: TensorSpec, *, backend: Kernels | Backend | str | None = None
) -> WeightValue:
    """One master tensor quantized as `quantized_values` quantizes it (same backend choice, same
    bytes) for a format whose bytes need no fuse partner (block FP8, MXFP8; not NVFP4's shared
    global scale). The caller checked `w` for NaN/Inf."""
    if spec.format is Format.NVFP4:
        raise ValueError(f"{spec.name}: quantize_tensor does not take NVFP4 (its global scale)")
    if spec.format is Format.BF16:
        return w.detach().to(torch.bfloat16, copy=True, memory_format=torch.contiguous_format)
    return _quantize(w.detach(), spec, None, None, backend_for(backend, w.device))[0]


def _global_amax(name, w, partner, amaxes) -> torch.Tensor | None:
    """`weight_amax(w, spec, partner, finite=True)` from the amaxes `check_finite` kept: the
    tensor's own, and for a 2-D fuse pair the max with the partner's (the same values without
    reading either again); None where the check kept none (the quantizer computes it)."""
    if name not in amaxes:
        return None
    if partner is None or w.dim() == 3:
        return amaxes[name]
    if partner not in amaxes or amaxes[partner].dim() != 0:
        return None
    return torch.maximum(amaxes[name], amaxes[partner])


def _quantize(w: torch.Tensor, spec: TensorSpec, partner, amax, backend: Backend, measure=False):
    """(the value, the SQNR's parts where measure=True and its kernel measures them, else
    None)."""
    block = spec.block or FP8_BLOCK_WEIGHT
    if spec.format is Format.FP8_BLOCK and block[1] not in KERNEL_FP8_BLOCK_SIZES:
        backend = Backend.REFERENCE  # the kernels' block sizes (mxrl.kernels.api)
    # the export checked every master tensor for NaN/Inf first (`check_finite`)
    kwargs = weight_quantizer_kwargs(w, spec, partner, finite=True, global_amax=amax)
    if measure:
        return quantize_measured(w, spec.format, **kwargs, backend=backend)
    return kernel_quantize(w, spec.format, **kwargs, backend=backend), None


def fuse_partners(plan: Plan) -> dict[str, str]:
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
