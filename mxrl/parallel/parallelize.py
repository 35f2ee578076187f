"""The trainer sharded with FSDP2: `fully_shard` per decoder layer, then the root.

As in torchtitan's `apply_fsdp`: each decoder layer is one FSDP unit (its parameters are
all-gathered just before its forward and freed after it, gradients reduce-scattered after its
backward), the root takes what is left (embeddings, final norm, lm_head), and the last layer
keeps its parameters after the forward (the backward needs them first). Parameters become
DTensors sharded on dim 0 over the train mesh; an optimizer built on `model.parameters()`
afterwards holds only its shard of the Adam moments (sharded optimizer state).

Mixed precision and the precision contract. A layer whose plan quantizes any tensor gathers its
fp32 master weights (`param_dtype=None`): its QLinear / QExperts quantize what they receive, and
the engine receives the export of the fp32 master, so a bf16 gather would make the trainer's
forward quantize other values than the rollout's. The compute dtype is the run's
(`rl.compute_dtype`, resolved once: `mxrl.rl.resolve`), set by the trainer as on one process
(`CausalLM.set_training_options`: bf16 compute is the model's autocast, which leaves the
quantized ops alone). Under bf16 compute on CUDA a layer the plan keeps wholly bf16 gathers bf16
(half the all-gather bytes), and gradients are reduced in fp32. Otherwise nothing changes dtype
in FSDP2: fp32 compute on CUDA gathers fp32, and on the CPU (the reference numerics) every
gather and reduction is fp32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from mxrl.formats.constants import Format
from mxrl.models import CausalLM
from mxrl.nn.qlinear import QLinear
from mxrl.nn.weight import WeightCache
from mxrl.recipe import Plan


def layer_policy(
    plan: Plan, layer: int, device_type: str, compute_dtype: torch.dtype | None
) -> MixedPrecisionPolicy:
    """The FSDP2 mixed-precision policy of decoder layer `layer` (the module docstring)."""
    if device_type != "cuda":
        return MixedPrecisionPolicy()  # fp32 everywhere: the CPU reference
    if compute_dtype != torch.bfloat16:
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)  # fp32 compute: fp32 gathers
    quantized = any(s.layer == layer and s.format is not Format.BF16 for s in plan.values())
    return MixedPrecisionPolicy(
        param_dtype=None if quantized else torch.bfloat16, reduce_dtype=torch.float32
    )


def parallelize(
    model: CausalLM, plan: Plan, mesh: DeviceMesh, compute_dtype: torch.dtype | None = None
) -> CausalLM:
    """Shard `model` (plan already applied, on this rank's device) over `mesh`, in place.
    Build the optimizer after this call and hand it to `attach_cache_reset`. compute_dtype: the
    run's (the model's autocast, which the caller sets); None: the parameters' dtype."""
    for name, module in model.named_modules():
        if isinstance(module, QLinear) and module._partner:
            # The partner is held by reference (not a parameter of the module): FSDP2 would
            # leave it pointing at the unsharded original. The fused gate_up layout (what
            # mxrl's models build) has no 2-D partners.
            raise ValueError(
                f"{name}: a 2-D gate/up fuse partner cannot be sharded by FSDP2 yet; use the "
                "fused expert layout (gate_up_proj), as mxrl.models builds it"
            )
    device_type = mesh.device_type
    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=layer_policy(plan, i, device_type, compute_dtype),
            reshard_after_forward=i < len(layers) - 1,
        )
    reduce = torch.float32 if device_type == "cuda" else None
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce))
    return model


def clear_quantized_caches(model: nn.Module) -> int:
    """Drop every cached quantized weight (`mxrl.nn.weight.WeightCache`) in `model`; returns
    how many caches were cleared.

    Under FSDP2 the cache's key (version counter, data_ptr) does not see a weight change: the
    all-gather writes the unsharded parameter outside autograd (its version stays 0) and the
    allocator hands the same address back step after step, so a layer could keep quantizing
    from a stale cache after an optimizer step. The weights change only in the optimizer step
    and in a checkpoint load: the trainer calls this after both (`attach_cache_reset`)."""
    cleared = 0
    for module in model.modules():
        for value in vars(module).values():
            caches = value.values() if isinstance(value, dict) else (value,)
            for cache in caches:
                if isinstance(cache, WeightCache):
                    cache.clear()
                    cleared += 1
    return cleared


def attach_cache_reset(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Clear the model's quantized-weight caches after every optimizer step."""
    optimizer.register_step_post_hook(lambda *_: clear_quantized_caches(model))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor is its own shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for a sharded DTensor; collective on its mesh)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def unshard_module(module: nn.Module) -> dict[str, torch.Tensor]:
    """name -> whole parameter (collective): for tests and single-process comparisons."""
    return {n: full(p.detach()) for n, p in module.named_parameters()}
