"""transformers reference models and the checkpoints they give, for the parity tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers", minversion="5.0")


def hf_model(cfg: dict[str, Any], seed: int = 0) -> Any:
    """A transformers CausalLM in fp32 whose every parameter is random.

    HF initialises norms to ones, biases to zeros and weights with std 0.02; we redraw them all
    (norms around 1, weights std 0.15) so that a swapped norm, bias or routing shows in the logits.
    """
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model.eval()


def save_fused(model: Any, path: Path, *, with_tied_head: bool = False) -> Path:
    """The fused-layout checkpoint of a transformers model: its in-memory state_dict verbatim.

    (transformers 5.23 `save_pretrained` converts experts back to the per-expert layout, so this
    is written by hand.)
    """
    path.mkdir(parents=True)
    model.config.save_pretrained(path)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings and not with_tied_head:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def save_hf(model: Any, path: Path) -> Path:
    """What transformers' own save_pretrained writes (per-expert layout for MoE models)."""
    model.save_pretrained(path)
    return path


def config_of(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def hf_routing(model: Any, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Top-k expert ids each HF router chose, [B, S, k] per MoE layer, in layer order."""
    captured: list[torch.Tensor] = []
    hooks = []
    B, S = input_ids.shape
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            hooks.append(
                gate.register_forward_hook(
                    lambda _m, _i, out: captured.append(out[2].reshape(B, S, -1))
                )
            )
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return captured
