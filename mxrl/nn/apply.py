"""apply_plan: swap a model's modules for quantized ones as its plan says, in place.

The model's parameter names must be the plan's canonical tensor names (mxrl.models builds them
so). Every tensor the plan names must be a parameter of the model and every parameter must be in
the plan: a mismatch means the plan was resolved for another model, and is an error.
"""

from __future__ import annotations

import torch
from torch import nn

from mxrl.formats.constants import Format
from mxrl.kernels import Backend, Kernels
from mxrl.kernels.backend import backend_for, default_kernels
from mxrl.nn.experts import EXPERT_PARAMS, GroupedExperts
from mxrl.nn.qlinear import QExperts, QLinear
from mxrl.nn.swap import Replacement, Swap, SwapRule, swap_modules
from mxrl.recipe import Plan, TensorSpec
from mxrl.recipe.schema import KVCacheFormat


def apply_plan(
    model: nn.Module, plan: Plan, *, backend: Kernels | Backend | str | None = None
) -> list[Swap]:
    """Replace nn.Linear by QLinear and GroupedExperts by QExperts wherever the plan gives a
    quantized format; bf16 tensors keep their high-precision modules. Returns what was swapped.

    backend: the run's `Kernels` record (its quantizer and row-wise kernels are used), or a
    quantizer backend checked here once for the model's device; None: `default_kernels` of the
    model's device (triton on CUDA when available, the reference on the CPU). The norms run
    fused where the row-wise kernels are Triton (`_set_rowwise`)."""
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device if params else torch.device("cpu")
    chosen = backend_for(backend, device)
    _check_names(params, plan)
    canonical = {id(p): name for name, p in params.items()}
    swaps = swap_modules(model, _trainer_rules(plan, chosen, canonical))
    _check_unsupported(model, plan, canonical)
    _link_fuse_partners(model)
    _set_kv_cache(model, plan)
    _set_rowwise(model, backend, device)
    return swaps


def _set_rowwise(
    model: nn.Module, backend: Kernels | Backend | str | None, device: torch.device
) -> None:
    """The row-wise kernels of the model's norms and RoPE (modules with a `rowwise` choice: the
    models' RMSNorm and ApplyRope): a `Kernels` record's, or the device default's where none is
    given (Triton on CUDA: the fused training RMSNorm and RoPE, mxrl.kernels.norm_train and
    rope_train). A backend given by name picks the quantizer only: they stay the eager
    reference."""
    if isinstance(backend, Kernels):
        rowwise = backend.rowwise
    elif backend is None:
        rowwise = default_kernels(device).rowwise
    else:
        rowwise = Backend.REFERENCE
    for module in model.modules():
        if hasattr(module, "rowwise"):
            module.rowwise = rowwise


def _trainer_rules(plan: Plan, backend: Backend, canonical: dict[int, str]) -> list[SwapRule]:
    """nn.Linear -> QLinear, GroupedExperts -> QExperts where the plan quantizes their tensors;
    a module quantized already is an error."""

    def refuse(name: str, module: nn.Module) -> None:
        raise ValueError(f"{name} is already quantized: apply_plan runs once per model")

    def experts(name: str, module: GroupedExperts) -> Replacement | None:
        gu, down = (plan[f"{name}.{param}"] for param in EXPERT_PARAMS.values())
        if gu.format is Format.BF16 and down.format is Format.BF16:
            return None
        return QExperts.from_experts(module, gu, down, plan.backward, backend), (gu, down)

    def linear(name: str, module: nn.Linear) -> Replacement | None:
        spec = plan[canonical[id(module.weight)]]
        if spec.format is Format.BF16:
            return None
        if spec.name != f"{name}.weight":
            raise ValueError(
                f"{name}.weight is tied to {spec.name}, which the plan makes {spec.format}; "
                "a tied weight cannot be quantized for one use only: keep it bf16"
            )
        return QLinear.from_linear(module, spec, plan.backward, backend), (spec,)

    return [
        SwapRule((QLinear, QExperts), refuse),
        SwapRule(GroupedExperts, experts),
        SwapRule(nn.Linear, linear),
    ]


def _set_kv_cache(model: nn.Module, plan: Plan) -> None:
    """`kv_cache: fp8`: every decoder layer's attention attends to the keys and values the FP8
    cache gives back (`mxrl.nn.kv_quant`); refused for a model whose layers do not all have
    such an attention (it would train on other keys than its rollouts used)."""
    if plan.kv_cache is KVCacheFormat.COMPUTE:
        return
    attention = [m for m in model.modules() if hasattr(m, "kv_fp8")]
    if len(attention) != plan.num_layers:
        raise ValueError(
            f"the plan's kv_cache: {plan.kv_cache.value} needs an FP8-capable attention in each "
            f"of its {plan.num_layers} layers; this model has {len(attention)}: use "
            "kv_cache: compute for it"
        )
    for module in attention:
        module.kv_fp8 = True


def swap_table(swaps: list[Swap]) -> str:
    """The audit of apply_plan as text: one line per swapped module."""
    if not swaps:
        return "no module swapped: every tensor is bf16"
    width = max(len(s.module) for s in swaps)
    lines = [f"{'module':<{width}}  {'now':<8}  formats"]
    for s in swaps:
        lines.append(f"{s.module:<{width}}  {s.new_type:<8}  {', '.join(map(str, s.formats))}")
    return "\n".join(lines)


def _check_names(params: dict[str, nn.Parameter], plan: Plan) -> None:
    missing = [n for n in plan if n not in params]
    extra = [n for n in params if n not in plan]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} plan tensor(s) the model lacks, e.g. {missing[:3]}")
        if extra:
            parts.append(f"{len(extra)} model parameter(s) the plan lacks, e.g. {extra[:3]}")
        raise ValueError(
            f"the plan ({plan.recipe_name}, {plan.hash()[:12]}) does not fit this model: "
            + "; ".join(parts)
            + ". Resolve the recipe against this model's own tensors "
            "(resolve(recipe, {n: p.shape for n, p in model.named_parameters()}))."
        )


def _check_unsupported(model: nn.Module, plan: Plan, canonical: dict[int, str]) -> None:
    """A quantized tensor that no quantized module took (an embedding, say) is an error."""
    handled = set()
    for module in model.modules():
        if isinstance(module, QLinear):
            handled.add(module.spec.name)
        elif isinstance(module, QExperts):
            handled.update(s.name for s in module.specs.values())
    for name, p in model.named_parameters():
        spec: TensorSpec = plan[canonical[id(p)]]
        if spec.format is not Format.BF16 and spec.name not in handled:
            owner = name.rsplit(".", 1)[0]
            kind = type(model.get_submodule(owner)).__name__
            raise ValueError(
                f"{name} ({kind}) is {spec.format} in the plan, but mxrl has no quantized "
                f"{kind}; keep kind {spec.kind} in bf16 in the recipe"
            )


def _link_fuse_partners(model: nn.Module) -> None:
    by_group: dict[str, list[QLinear]] = {}
    for module in model.modules():
        if isinstance(module, QLinear) and module.spec.fuse_group is not None:
            by_group.setdefault(module.spec.fuse_group, []).append(module)
    for group, members in by_group.items():
        if len(members) != 2:
            raise ValueError(f"fuse group {group} has {len(members)} quantized linears, not 2")
        a, b = members
        a.set_fuse_partner(b.weight)
        b.set_fuse_partner(a.weight)
