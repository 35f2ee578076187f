"""HF checkpoint names <-> model parameters: the one adapter of the Qwen families.

Model parameters carry the canonical HF names of the **fused** expert layout (what transformers
>= 5 holds in memory). On disk, routed experts come in two layouts:

- "per_expert": `model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight`, [I, H], [I, H],
  [H, I] — published checkpoints (Qwen/Qwen3-30B-A3B) and what transformers 5 `save_pretrained`
  writes (it converts back on save).
- "fused": `model.layers.{L}.mlp.experts.gate_up_proj` [E, 2I, H] (rows 0..I-1 of expert e are
  gate_proj, rows I..2I-1 up_proj) and `mlp.experts.down_proj` [E, H, I].

Every other name is the same on disk and in the model. Loading, saving, conversion and the
engine's weight loader all go through `target_of` (disk -> parameter slice) and `hf_tensors`
(parameters -> disk names), so the two directions cannot drift apart.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from mxrl.arch.hf import EXPERT_LAYOUTS

_PER_EXPERT_RE = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight"
)
_GATE_UP_SUFFIX = ".mlp.experts.gate_up_proj"
_DOWN_SUFFIX = ".mlp.experts.down_proj"


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a whole parameter, or one expert's slice of a fused one.

    part: None (the whole parameter), or "gate" / "up" (half of `gate_up_proj[expert]`) or
    "down" (`down_proj[expert]`).
    """

    param: str
    expert: int | None = None
    part: str | None = None

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """The slice of `param` this tensor fills (a view: copy_ into it writes the parameter)."""
        if self.expert is None:
            return param
        w = param[self.expert]
        if self.part == "down":
            return w
        inter = w.shape[0] // 2
        return w[:inter] if self.part == "gate" else w[inter:]

    @property
    def unit(self) -> tuple[int, str] | None:
        """What this tensor covers of its parameter (None: all of it), to find duplicates."""
        return None if self.expert is None else (self.expert, self.part or "")


def target_of(name: str) -> Target:
    """The parameter (slice) a checkpoint tensor name loads into; unknown names map to
    themselves and are caught by the caller's parameter lookup."""
    m = _PER_EXPERT_RE.fullmatch(name)
    if m is None:
        return Target(name)
    prefix, expert, part = m.groups()
    proj = "down_proj" if part == "down" else "gate_up_proj"
    return Target(f"{prefix}.{proj}", int(expert), part)


def hf_location(param_name: str, index: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """Where element `index` of parameter `param_name` (of `shape`) lives in a per-expert HF
    checkpoint, e.g. `model.layers.1.mlp.experts.3.up_proj.weight[1, 2]`: the name a user
    finds in their files. Other parameters keep their name."""
    if param_name.endswith(_GATE_UP_SUFFIX) and len(index) == 3:
        expert, row, col = index
        inter = shape[1] // 2
        part, row = ("gate", row) if row < inter else ("up", row - inter)
        prefix = param_name.removesuffix(".gate_up_proj")
        return f"{prefix}.{expert}.{part}_proj.weight[{row}, {col}]"
    if param_name.endswith(_DOWN_SUFFIX) and len(index) == 3:
        expert, row, col = index
        prefix = param_name.removesuffix(".down_proj")
        return f"{prefix}.{expert}.down_proj.weight[{row}, {col}]"
    return f"{param_name}[{', '.join(str(i) for i in index)}]"


def units_of(param_name: str, param: torch.Tensor) -> set[tuple[int, str]]:
    """Every per-expert unit a fused expert parameter is made of (empty for other parameters)."""
    if param_name.endswith(_GATE_UP_SUFFIX):
        return {(e, part) for e in range(param.shape[0]) for part in ("gate", "up")}
    if param_name.endswith(_DOWN_SUFFIX):
        return {(e, "down") for e in range(param.shape[0])}
    return set()


def hf_tensors(
    state: Mapping[str, torch.Tensor], expert_layout: str = "per_expert"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for a model state dict in the given expert layout.

    Per-expert tensors are views of the fused parameters (no copy), in published order: for each
    expert, gate_proj, up_proj, down_proj (= `tensors_from_hf_config(cfg, "per_expert")`).
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout: {expert_layout!r} is not one of {EXPERT_LAYOUTS}")
    for name, tensor in state.items():
        if expert_layout == "fused" or not name.endswith((_GATE_UP_SUFFIX, _DOWN_SUFFIX)):
            yield name, tensor
            continue
        if name.endswith(_DOWN_SUFFIX):
            continue  # emitted with its gate_up_proj, expert by expert
        prefix = name.removesuffix(".gate_up_proj")
        down = state.get(prefix + ".down_proj")
        assert down is not None, f"{name} without its {prefix}.down_proj"
        inter = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :inter]
            yield f"{prefix}.{e}.up_proj.weight", tensor[e, inter:]
            yield f"{prefix}.{e}.down_proj.weight", down[e]
