"""`Family`: the table a model family's file fills (docs/design.md §4.3, docs/models.md "Adding a
model family"). The shared code (`classify`, `tensors_from_hf_config`, `ModelConfig.from_hf` and
`to_hf`) reads it by the config's `model_type` and holds no family switch of its own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mxrl.arch.hf import LayerTensors, TensorList, decoder_tensors
from mxrl.arch.names import Piece

# (cfg, number of layers) -> the family's ModelConfig keywords (biases, q/k norm, MoE fields)
ConfigFields = Callable[[Mapping[str, Any], int], dict[str, Any]]
# a ModelConfig -> the family's switches as config.json keys (a config built without one)
HFFields = Callable[[Any], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    """One model family.

    model_type: config.json's "model_type".
    architecture: the HF class `save_pretrained` writes; None for a family recipes resolve
        against but `mxrl.models` does not build (then `config_fields` and `hf_fields` are None).
    pieces: the tensor groups (`mxrl.arch.names.Piece`) its layer tensors are made of.
    layer_tensors: `(cfg, prefix, hidden, layer, expert_layout)` -> one decoder layer's attention
        and MLP tensors (names and shapes from config.json alone, in HF state_dict order).
    config_fields, hf_fields: the family's part of `ModelConfig.from_hf` and `to_hf`.
    rope_types: the RoPE types (`rope_scaling` / `rope_parameters`) its model implements;
        "yarn" as `mxrl.models.yarn` (DeepSeek-V3).
    unbuilt_layers: config -> how many layers after `num_hidden_layers` a checkpoint may hold
        that `mxrl.models` does not build (DeepSeek-V3's multi-token-prediction layers), whose
        tensors `from_pretrained` skips as transformers does; None: none.
    """

    model_type: str
    architecture: str | None
    pieces: tuple[Piece, ...]
    layer_tensors: LayerTensors
    config_fields: ConfigFields | None = None
    hf_fields: HFFields | None = None
    rope_types: tuple[str, ...] = ("default",)
    unbuilt_layers: Callable[[Mapping[str, Any]], int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_type, str) or not self.model_type:
            raise ValueError(f"Family.model_type must be a non-empty str, got {self.model_type!r}")
        if not self.pieces or not all(isinstance(p, Piece) for p in self.pieces):
            raise TypeError(
                f"Family {self.model_type}: pieces must be a non-empty tuple of "
                f"mxrl.arch.names.Piece, got {self.pieces!r}"
            )
        built = (self.config_fields is not None, self.hf_fields is not None)
        if built != (self.architecture is not None,) * 2:
            raise ValueError(
                f"Family {self.model_type}: architecture={self.architecture!r} with "
                f"config_fields/hf_fields set={built}: a family mxrl.models builds names its HF "
                "architecture and gives both; a names-only family (architecture=None) neither"
            )

    def tensors(self, cfg: Mapping[str, Any], expert_layout: str) -> TensorList:
        """(canonical name, shape) of every tensor of the model, in HF state_dict order."""
        return decoder_tensors(cfg, expert_layout, self.layer_tensors)
