"""The plan applied: one place that turns a TensorSpec into a `formats.quantize` call.

Training ops, the rollout engine, weight export and checkpoint conversion all quantize through
these two functions, so a tensor's bytes depend only on its values and its spec.

NVFP4 weight global scales (the second-level FP32 scale):
- 2-D weight: one per tensor; with a fuse partner (gate+up of one MLP/expert stored apart), one
  for the pair: amax = max(amax(gate), amax(up)).
- 3-D expert weight [E, N, K]: one per expert ([E, 1, 1]). A fused `gate_up_proj` whose spec has
  no fuse group gets one per half ([E, 2I, 1], each row holding its half's amax), which is what
  the per-expert layout would give.
`weight_global_scale` names that granularity and `weight_layout` the fields a weight's QTensor
stores under its spec (`mxrl.formats.stored_layout`): what every receiver checks a record against.
"""

from __future__ import annotations

from typing import Any

import torch

from mxrl.formats import QTensor, quantize, stored_layout
from mxrl.formats.constants import Format
from mxrl.recipe.plan import TensorSpec

__all__ = [
    "activation_quantizer_kwargs",
    "own_weight_amax",
    "quantize_activation",
    "quantize_weight",
    "weight_amax",
    "weight_global_scale",
    "weight_layout",
    "weight_quantizer_kwargs",
]


def weight_global_scale(spec: TensorSpec) -> str:
    """The granularity of an NVFP4 weight's global scale (module docstring), as
    `mxrl.formats.GLOBAL_SCALES` names it: "tensor" for a 2-D weight (a fuse pair shares one
    value), "row" for a fused 3-D gate_up without a fuse group (one per half, repeated over
    its rows), "matrix" (one per expert) for other 3-D weights. `own_weight_amax` computes
    exactly these shapes."""
    if len(spec.shape) != 3:
        return "tensor"
    return "row" if spec.role == "gate_up" and spec.fuse_group is None else "matrix"


def weight_layout(spec: TensorSpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of every field the weight's QTensor stores under its spec (row-wise: the
    layout the export writes, checkpoints hold and the engine keeps)."""
    if spec.format is Format.BF16:
        raise ValueError(f"{spec.name} is bf16 in the plan: it is stored as a plain tensor")
    return stored_layout(
        spec.format, spec.shape, block=spec.block, global_scale=weight_global_scale(spec)
    )


def weight_amax(
    weight: torch.Tensor,
    spec: TensorSpec,
    partner: torch.Tensor | None = None,
    *,
    finite: bool = False,
) -> torch.Tensor | None:
    """The NVFP4 global amax a weight is quantized with (module docstring); None otherwise.

    finite: the caller has checked that weight and partner hold no NaN/Inf (the export does):
    each amax is then one read of the tensor (the infinity norm, which is exactly max |x|)
    instead of a read of a NaN/Inf-zeroed fp32 copy. The same values either way."""
    amax = own_weight_amax(weight, spec, finite=finite)
    if amax is not None and partner is not None and weight.dim() != 3:
        amax = torch.maximum(amax, _amax(partner.detach(), None, finite))
    return amax


def own_weight_amax(
    weight: torch.Tensor, spec: TensorSpec, *, finite: bool = False
) -> torch.Tensor | None:
    """`weight_amax` before its fuse partner's max: the amax(es) of this tensor's own values
    (per tensor, per expert or per half, the module docstring). For a 2-D fuse pair, the
    global amax is the `torch.maximum` of the two tensors' own amaxes.

    finite=True reads the tensor once and propagates NaN/Inf (the infinity norm), so the
    export uses these amaxes as its NaN/Inf check of an NVFP4 tensor: all of them are finite
    exactly when the tensor is (mxrl.weights.export.check_finite)."""
    if spec.format is not Format.NVFP4:
        return None
    w = weight.detach()
    if w.dim() == 3:
        if spec.role == "gate_up" and spec.fuse_group is None:
            half = w.shape[1] // 2
            gate = _amax(w[:, :half], (1, 2), finite).expand(-1, half, 1)
            up = _amax(w[:, half:], (1, 2), finite).expand(-1, half, 1)
            return torch.cat([gate, up], dim=1)
        return _amax(w, (1, 2), finite)
    return _amax(w, None, finite)


def _amax(t: torch.Tensor, dim: tuple[int, ...] | None, finite: bool) -> torch.Tensor:
    """max |t| over finite elements in fp32 (keepdim over `dim`; all of it for None): global
    amaxes are over finite elements (docs/formats.md, "Non-finite inputs"), so a non-finite
    weight element spoils its own block only. The infinity norm is that maximum exactly (it
    only compares magnitudes); finite: t holds no NaN/Inf, so it is one read of t; otherwise
    of t with NaN/Inf set to 0 (one copy: a training step quantizes every NVFP4 weight after
    each optimizer step, and a masked |t| took four)."""
    if not finite:  # (fp32 first: an fp64 value past fp32's range is an Inf, skipped)
        t = torch.nan_to_num(t.detach().float(), nan=0.0, posinf=0.0, neginf=0.0)
    if dim is None:
        return torch.linalg.vector_norm(t, ord=float("inf")).float()
    return torch.linalg.vector_norm(t, ord=float("inf"), dim=dim, keepdim=True).float()


def weight_quantizer_kwargs(
    weight: torch.Tensor,
    spec: TensorSpec,
    partner: torch.Tensor | None = None,
    *,
    axis: int = -1,
    check_finite: bool = False,
    finite: bool = False,
    global_amax: torch.Tensor | None = None,
) -> dict:
    """quantize() options for a (master) weight per its spec (the module docstring's global
    scales); `axis=-2` gives MXFP8's column-wise copy (blocks along the output features).
    finite: the caller checked the weight for NaN/Inf (`weight_amax`'s one-read path).
    global_amax: an NVFP4 weight's `weight_amax` (fuse partner included) computed by the
    caller (the export keeps the one its NaN/Inf check read); None computes it here."""
    if spec.format is Format.BF16:
        raise ValueError(f"{spec.name} is bf16 in the plan: there is nothing to quantize")
    if tuple(weight.shape) != spec.shape:
        raise ValueError(
            f"{spec.name}: the plan says shape {spec.shape}, the tensor has "
            f"{tuple(weight.shape)}; re-resolve the plan against this model"
        )
    kwargs: dict = {"check_finite": check_finite}
    if spec.format is Format.NVFP4:
        if global_amax is None:
            global_amax = weight_amax(weight, spec, partner, finite=finite)
        kwargs["global_amax"] = global_amax
        # weight_amax's values are finite and >= 0 (over finite elements, or after the caller's
        # NaN/Inf check): no host read to check them again (one sync per tensor on a GPU)
        kwargs["check_amax"] = False
        if spec.scale_mode is not None:
            kwargs["scale_mode"] = spec.scale_mode
    elif spec.format is Format.FP8_BLOCK:
        kwargs["block"] = spec.block
    elif axis != -1:
        kwargs["axis"] = axis % weight.dim()
    return kwargs


def quantize_weight(
    weight: torch.Tensor, spec: TensorSpec, partner: torch.Tensor | None = None, **options: Any
) -> QTensor:
    """Quantize a (master) weight per its spec with the reference quantizer (the export path);
    `options` are `weight_quantizer_kwargs`'s keywords (axis, check_finite, ...)."""
    kwargs = weight_quantizer_kwargs(weight, spec, partner, **options)
    return quantize(weight.detach(), spec.format, **kwargs)


def activation_quantizer_kwargs(spec: TensorSpec) -> dict:
    """quantize() options for the activation entering this weight's GEMM (1x32 MXFP8 rows,
    NVFP4 per token or per tensor with the spec's block-scale rule, 1x128 block FP8)."""
    if spec.format is Format.NVFP4:
        kwargs: dict = {"per_token": spec.activations == "per_token"}
        if spec.scale_mode is not None:
            kwargs["scale_mode"] = spec.scale_mode
        return kwargs
    if spec.format is Format.FP8_BLOCK:
        assert spec.block is not None
        return {"block": (1, spec.block[1])}
    return {}


def quantize_activation(x: torch.Tensor, spec: TensorSpec) -> QTensor:
    """Quantize the activation [..., K] entering the GEMM of the weight `spec` describes."""
    if spec.format is Format.BF16:
        raise ValueError(f"{spec.name} is bf16 in the plan: its activations stay high precision")
    return quantize(x.detach(), spec.format, **activation_quantizer_kwargs(spec))
