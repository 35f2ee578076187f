"""Helpers shared by the sync tests: the tiny MoE, record hashes, the engine's logits."""

import torch

from mxrl.arch import builtin_config
from mxrl.engine import Engine
from mxrl.models import build_model

PRESETS = ("bf16", "mxfp8", "nvfp4-dequantized")
PROMPT = [3, 14, 15, 9, 26, 5, 35, 8]
_NVFP4 = {"format": "nvfp4", "activations": "per_token"}
# every 2-D tensor NVFP4 (a per-tensor global amax; the shared expert's gate and up a 2-D fuse
# pair sharing one), the routed experts NVFP4 per expert with gate_up fused; bf16 norms, router
# and embeddings
ALL_NVFP4 = {
    "name": "all-nvfp4",
    "backward": "dequantized",
    "default": "bf16",
    "rules": [
        {"match": {"kind": "router"}, "format": "bf16"},
        {"match": {"kind": "attention"}, **_NVFP4},
        {"match": {"kind": "shared_expert"}, **_NVFP4, "fuse": ["gate", "up"]},
        {"match": {"kind": "routed_expert"}, **_NVFP4, "fuse": ["gate", "up"]},
    ],
}
# block FP8 in 32x32 blocks: the tiny MoE's K (64, 32) takes no 128-wide block
FP8_BLOCK_32 = {
    "name": "fp8-block-32",
    "backward": "high_precision",
    "default": "bf16",
    "rules": [
        {"match": {"kind": "router"}, "format": "bf16"},
        {"match": {"kind": ["attention", "routed_expert"]}, "format": "fp8_block",
         "block": [32, 32]},
    ],
}  # fmt: skip

# every stored layout in one plan: MXFP8 q/k/v, block FP8 (32x32) o_proj, the shared expert NVFP4
# with a per-tensor global scale (gate and up sharing one), the routed experts NVFP4 per expert
# (layers 0-1, gate_up fused) and per half (layers 2-3: gate_up without a fuse group); bf16
# routers, norms and embeddings
MIXED = {
    "name": "mixed",
    "backward": "dequantized",
    "default": "bf16",
    "rules": [
        {"match": {"kind": "router"}, "format": "bf16"},
        {"match": {"name": "*.self_attn.o_proj.weight"}, "format": "fp8_block", "block": [32, 32]},
        {"match": {"kind": "attention"}, "format": "mxfp8"},
        {"match": {"kind": "shared_expert"}, **_NVFP4, "fuse": ["gate", "up"]},
        {"match": {"kind": "routed_expert", "layers": "0-1"}, **_NVFP4, "fuse": ["gate", "up"]},
        {"match": {"kind": "routed_expert"}, **_NVFP4},
    ],
}


def tiny(seed: int = 0, dtype: torch.dtype = torch.float32):
    return build_model(builtin_config("tiny-moe"), dtype=dtype, seed=seed)


def hashes(records) -> dict[str, str]:
    return {r.name: r.hash for r in records}


def engine_logits(engine: Engine, ids=PROMPT) -> torch.Tensor:
    """The engine's logits for the last token of `ids` (one prefill through its own runner)."""
    return engine.next_token_logits([ids])
