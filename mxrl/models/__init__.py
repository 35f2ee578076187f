"""Model definitions shared by trainer and rollout engine, and HF checkpoint I/O (`ModelConfig`
and the HF <-> model name mapping are `mxrl.arch`'s).

    from mxrl.models import build_model, from_pretrained, save_pretrained
    model = from_pretrained("path/to/Qwen3-30B-A3B", dtype=torch.bfloat16, device="cuda")
    logits, routing = model(input_ids, return_routing=True)
    save_pretrained(model, "out/step-100", max_shard_size="5GB")

Families: qwen3 (dense), qwen3_moe, qwen2_moe (and qwen3_moe with a shared expert), deepseek_v3
(MLA and the sigmoid router, `mxrl.models.mla`). Parameter
names are the canonical HF names of the fused expert layout. docs/models.md has the details.
"""

from mxrl.models.hf_checkpoint import from_pretrained
from mxrl.models.hf_save import parse_size, save_pretrained
from mxrl.models.layers import (
    MLP,
    Attention,
    DecoderLayer,
    KVCache,
    RMSNorm,
    RotaryEmbedding,
    SparseMoeBlock,
    causal_mask,
)
from mxrl.models.model import CausalLM, DecoderModel, build_model, empty_model, init_weights
from mxrl.models.tokenizer import CharTokenizer, load_tokenizer

__all__ = [
    "MLP",
    "Attention",
    "CausalLM",
    "CharTokenizer",
    "DecoderLayer",
    "DecoderModel",
    "KVCache",
    "RMSNorm",
    "RotaryEmbedding",
    "SparseMoeBlock",
    "build_model",
    "causal_mask",
    "empty_model",
    "from_pretrained",
    "init_weights",
    "load_tokenizer",
    "parse_size",
    "save_pretrained",
]
