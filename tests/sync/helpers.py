"""Helpers shared by the sync tests: the tiny MoE, record hashes, the engine's logits."""

import torch

from mxrl.engine import Engine
from mxrl.models import build_model
from mxrl.recipe import builtin_config

PRESETS = ("bf16", "mxfp8", "nvfp4-dequantized")
PROMPT = [3, 14, 15, 9, 26, 5, 35, 8]


def tiny(seed: int = 0, dtype: torch.dtype = torch.float32):
    return build_model(builtin_config("tiny-moe"), dtype=dtype, seed=seed)


def hashes(records) -> dict[str, str]:
    return {r.name: r.hash for r in records}


def engine_logits(engine: Engine, ids=PROMPT) -> torch.Tensor:
    """The engine's logits for the last token of `ids` (one prefill through its own runner)."""
    return engine.next_token_logits([ids])
