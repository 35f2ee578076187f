"""What each model family is: its tensor names and kinds, its tensors from config.json alone,
its ModelConfig, and the HF <-> model mapping of SwiGLU experts (docs/design.md §4.3).

    from mxrl.arch import builtin_config, classify_tensors, tensors_from_hf_config
    tensors = tensors_from_hf_config(builtin_config())    # [(name, shape)], HF state_dict order
    infos = classify_tensors(name for name, _ in tensors)  # name -> TensorInfo(kind, layer, ...)

names.py (canonical HF tensor names -> Kind, layer, expert, role), hf.py (config.json -> tensor
names and shapes; the built-in configs), config.py (`ModelConfig`), experts.py (the HF <-> model
adapter of routed experts). Imports nothing of mxrl's outside this folder: `recipe/` resolves
plans from it and `models/` builds from it.
"""

from mxrl.arch.config import ARCHITECTURES, MODEL_TYPES, ModelConfig
from mxrl.arch.experts import Target, hf_location, hf_tensors, target_of, units_of
from mxrl.arch.hf import (
    BUILTIN_CONFIGS,
    EXPERT_LAYOUTS,
    SUPPORTED_MODEL_TYPES,
    builtin_config,
    load_hf_config,
    tensors_from_hf_config,
)
from mxrl.arch.names import (
    SUPPORTED_FAMILIES,
    Kind,
    TensorInfo,
    classify,
    classify_tensors,
    gate_up_group,
    is_matmul_weight,
    mla_layers,
)

__all__ = [
    "ARCHITECTURES",
    "BUILTIN_CONFIGS",
    "EXPERT_LAYOUTS",
    "MODEL_TYPES",
    "SUPPORTED_FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "Kind",
    "ModelConfig",
    "Target",
    "TensorInfo",
    "builtin_config",
    "classify",
    "classify_tensors",
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
