"""Which tensor gets which format: Recipe (YAML) -> Plan (tensor name -> TensorSpec).

    from mxrl.arch import builtin_config, tensors_from_hf_config
    from mxrl.recipe import resolve
    plan = resolve("nvfp4-dequantized", tensors_from_hf_config(builtin_config()))
    print(plan.table()); plan.hash()

docs/recipes.md explains rules, selectors, presets and what the plan hash covers.
"""

from mxrl.recipe.layers import LayerSelector, parse_layers
from mxrl.recipe.plan import PLAN_SCHEMA_VERSION, Plan, TensorSpec
from mxrl.recipe.resolver import resolve
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
    "PLAN_SCHEMA_VERSION",
    "Backward",
    "LayerSelector",
    "Match",
    "Plan",
    "Recipe",
    "Rule",
    "TensorSpec",
    "list_presets",
    "load_recipe",
    "parse_layers",
    "recipe_from_dict",
    "resolve",
]
