"""What each model family is: its tensor names and kinds, its tensors from config.json alone,
its ModelConfig, and the HF <-> model mapping of SwiGLU experts (docs/design.md §4.3).

    from mxrl.arch import builtin_config, classify_tensors, tensors_from_hf_config
    tensors = tensors_from_hf_config(builtin_config())    # [(name, shape)], HF state_dict order
    infos = classify_tensors(name for name, _ in tensors)  # name -> TensorInfo(kind, layer, ...)

One file per family (qwen3.py, qwen3_moe.py, qwen2_moe.py, deepseek_v3.py) fills a `Family`
(family.py): its pieces, its tensors, its ModelConfig switches; `FAMILIES` below registers them.
The shared code: names.py (the pieces; canonical HF tensor names -> Kind, layer, expert, role),
hf.py (config.json -> tensor names and shapes through the family; the built-in configs),
config.py (`ModelConfig`), experts.py (the HF <-> model adapter of routed experts). Imports nothing of mxrl's outside this folder: `recipe/` resolves
plans from it and `models/` builds from it.
"""

from mxrl.arch.config import ModelConfig
from mxrl.arch.deepseek_v3 import DEEPSEEK_V3
from mxrl.arch.experts import Target, hf_location, hf_tensors, target_of, units_of
from mxrl.arch.family import Family
from mxrl.arch.hf import (
    BUILTIN_CONFIGS,
    EXPERT_LAYOUTS,
    builtin_config,
    load_hf_config,
    tensors_from_hf_config,
)
from mxrl.arch.names import (
    Kind,
    Piece,
    TensorInfo,
    classify,
    classify_tensors,
    gate_up_group,
    is_matmul_weight,
    mla_layers,
)
from mxrl.arch.qwen2_moe import QWEN2_MOE
from mxrl.arch.qwen3 import QWEN3
from mxrl.arch.qwen3_moe import QWEN3_MOE

# The registered families, the one list of model types (docs/models.md, "Adding a model family").
FAMILIES: tuple[Family, ...] = (QWEN3, QWEN3_MOE, QWEN2_MOE, DEEPSEEK_V3)


def family(model_type: str) -> Family:
    """The registered family of config.json's `model_type`; ValueError naming the known ones."""
    for f in FAMILIES:
        if f.model_type == model_type:
            return f
    known = ", ".join(f.model_type for f in FAMILIES)
    raise ValueError(f"model_type {model_type!r} is not a registered family; known: {known}")


__all__ = [
    "BUILTIN_CONFIGS",
    "EXPERT_LAYOUTS",
    "FAMILIES",
    "Family",
    "Kind",
    "ModelConfig",
    "Piece",
    "Target",
    "TensorInfo",
    "builtin_config",
    "classify",
    "classify_tensors",
    "family",
    "gate_up_group",
    "hf_location",
    "hf_tensors",
    "is_matmul_weight",
    "load_hf_config",
    "mla_layers",
    "target_of",
    "tensors_from_hf_config",
    "units_of",
]
