"""A served checkpoint's config.json: the `quantization_config` serving stacks read (HF
fine-grained FP8, compressed-tensors) and mxrl's own `mxrl` key (mxrl.weights.served writes the
tensors; docs/checkpoints.md)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from mxrl import __version__
from mxrl.arch.names import Kind
from mxrl.formats.constants import Format
from mxrl.recipe import Plan
from mxrl.recipe.schema import KVCacheFormat

GATE_UP = ".mlp.experts.gate_up_proj"
DOWN = ".mlp.experts.down_proj"
_CT_VERSION = "0.20.1"  # the compressed-tensors release whose config schema this writes


class ServedFormat(StrEnum):
    """The quantization_config a served checkpoint carries."""

    NONE = "none"  # a bf16 plan: a plain HF checkpoint
    HF_FP8 = "fp8"  # HF fine-grained FP8 (transformers FineGrainedFP8Config, vLLM/SGLang `fp8`)
    COMPRESSED_TENSORS = "compressed-tensors"


def linear_modules(plan: Plan) -> dict[str, Format]:
    """Every Linear module of the served checkpoint with its format (fused experts per expert,
    and the experts' module `...mlp.experts` itself, as transformers and vLLM name it)."""
    out: dict[str, Format] = {}
    for spec in plan.values():
        if spec.kind in (Kind.NORM, Kind.EMBEDDING) or not spec.name.endswith(
            (".weight", GATE_UP, DOWN)
        ):
            continue
        if spec.name.endswith((GATE_UP, DOWN)):
            prefix = spec.name.rsplit(".", 1)[0]
            out[prefix] = spec.format  # gate_up and down of one layer share a format (checked)
            parts = ("down_proj",) if spec.name.endswith(DOWN) else ("gate_proj", "up_proj")
            for e in range(spec.shape[0]):
                for part in parts:
                    out[f"{prefix}.{e}.{part}"] = spec.format
        elif len(spec.shape) == 2:
            out[spec.name.removesuffix(".weight")] = spec.format
    return out


def quantization_config(plan: Plan, fmt: ServedFormat) -> dict[str, Any] | None:
    """config.json's `quantization_config` for `plan` in `fmt` (None for a bf16 plan)."""
    modules = linear_modules(plan)
    skipped = sorted(m for m, f in modules.items() if f is Format.BF16)
    if fmt is ServedFormat.NONE:
        return None
    if fmt is ServedFormat.HF_FP8:
        block = next(s.block for s in plan.values() if s.format is Format.FP8_BLOCK)
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            "modules_to_not_convert": skipped,
        }
    groups: dict[str, Any] = {}
    for f in (Format.MXFP8, Format.NVFP4):
        targets = sorted(m for m, g in modules.items() if g is f)
        if targets:
            groups[f"group_{len(groups)}"] = _ct_group(f, targets)
    formats = {g["format"] for g in groups.values()}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": skipped,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
        "version": _CT_VERSION,
    }


def _ct_args(num_bits: int, strategy: str, group: int, scale_dtype: str, dynamic) -> dict:
    return {
        "num_bits": num_bits,
        "type": "float",
        "symmetric": True,
        "strategy": strategy,
        "group_size": group,
        "block_structure": None,
        "dynamic": dynamic,
        "actorder": None,
        "observer": None if dynamic is True else "minmax",
        "observer_kwargs": {},
        "scale_dtype": scale_dtype,
        "zp_dtype": scale_dtype,
    }


def _ct_group(fmt: Format, targets: list[str]) -> dict[str, Any]:
    if fmt is Format.MXFP8:
        return {
            "targets": targets,
            "weights": _ct_args(8, "group", 32, "torch.uint8", False),
            "input_activations": _ct_args(8, "group", 32, "torch.uint8", True),
            "output_activations": None,
            "format": "mxfp8-quantized",
        }
    return {
        "targets": targets,
        "weights": _ct_args(4, "tensor_group", 16, "torch.float8_e4m3fn", False),
        "input_activations": None,  # per-token global scales: see the module docstring
        "output_activations": None,
        "format": "nvfp4-pack-quantized",
    }


def precision_contract(plan: Plan) -> dict[str, Any]:
    """config.json's `mxrl` key: the recipe, the plan hash and what the activations do."""
    acts = sorted({s.activations for s in plan.values() if s.activations})
    formats = sorted({str(s.format) for s in plan.values() if s.format is not Format.BF16})
    out: dict[str, Any] = {
        "mxrl_version": __version__,
        "recipe": plan.recipe_name,
        "plan_hash": plan.hash(),
        "formats": formats,
    }
    if plan.kv_cache is not KVCacheFormat.COMPUTE:
        out["kv_cache"] = {
            "format": plan.kv_cache.value,
            "note": (
                "mxrl's FP8 KV cache scales each token's key and value vector per KV head "
                "(fp32, amax / 448); serving stacks' FP8 KV caches use static per-tensor "
                "k_scale / v_scale, so none is written: serve with a bf16 cache, or an FP8 one "
                "of your stack's, which differs from the policy's rollouts"
            ),
        }
    if acts:
        out["nvfp4_activations"] = {
            "global_scale": acts,
            "note": (
                "mxrl quantizes NVFP4 activations at run time with one global scale per "
                "token (per_token) or per tensor; compressed-tensors can only state a static "
                "calibrated input_global_scale, so the weights are exported weight-only"
            ),
        }
    return out
