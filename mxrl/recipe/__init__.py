"""Which tensor gets which format: Recipe (YAML) -> Plan (tensor name -> TensorSpec).

    from mxrl.recipe import resolve, tensors_from_hf_config, builtin_config
    plan = resolve("nvfp4-dequantized", tensors_from_hf_config(builtin_config()))
    print(plan.table()); plan.hash()

docs/recipes.md explains rules, selectors, presets and what the plan hash covers.
"""

from mxrl.recipe.hf_config import (
    BUILTIN_CONFIGS,
    EXPERT_LAYOUTS,
    SUPPORTED_MODEL_TYPES,
    builtin_config,
    load_hf_config,
    tensors_from_hf_config,
)
from mxrl.recipe.layers import LayerSelector, parse_layers
from mxrl.recipe.names import Kind, TensorInfo, classify, classify_tensors, is_matmul_weight
from mxrl.recipe.plan import PLAN_SCHEMA_VERSION, Plan, TensorSpec, resolve
from mxrl.recipe.schema import (
    Backward,
    Match,
    Recipe,
    Rule,
    list_presets,
    load_recipe,
    recipe_from_dict,
)

__all__ = [
    "BUILTIN_CONFIGS",
    "EXPERT_LAYOUTS",
    "PLAN_SCHEMA_VERSION",
    "SUPPORTED_MODEL_TYPES",
    "Backward",
    "Kind",
    "LayerSelector",
    "Match",
    "Plan",
    "Recipe",
    "Rule",
    "TensorInfo",
    "TensorSpec",
    "builtin_config",
    "classify",
    "classify_tensors",
    "is_matmul_weight",
    "list_presets",
    "load_hf_config",
    "load_recipe",
    "parse_layers",
    "recipe_from_dict",
    "resolve",
    "tensors_from_hf_config",
]
