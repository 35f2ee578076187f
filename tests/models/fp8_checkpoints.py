"""Tiny HF fine-grained FP8 checkpoints, quantized by transformers (the independent oracle):
an unquantized model saved by mxrl, then every Linear of the release layout (attention, MLP,
experts; not the router, embeddings, norms, lm_head) replaced by transformers' `Fp8Quantize`
codes and `weight_scale_inv`, with config.json's `quantization_config` as a release has it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize
from transformers.utils.quantization_config import FineGrainedFP8Config

from mxrl.models import build_model, save_pretrained

_BASE = {
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
# every quantized dim a multiple of 128
FULL = _BASE
# partial blocks: k/v_proj [192, 256] and expert gate/up [192, 256] (a partial row block),
# o_proj [256, 384] and expert down_proj [256, 192] (a partial column block)
PARTIAL = {
    **_BASE,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "moe_intermediate_size": 192,
}
# partial row blocks only (k/v_proj [192, 256]): what the fp8-block recipe takes (its K must be
# a multiple of 128)
ROWS = {**_BASE, "num_attention_heads": 6, "num_key_value_heads": 3}
QUANTIZED = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight")


def quantizer(scale_fmt: str = "float") -> Fp8Quantize:
    config = FineGrainedFP8Config(weight_block_size=(128, 128), scale_fmt=scale_fmt)
    return Fp8Quantize(SimpleNamespace(quantization_config=config))


def dequantizer() -> Fp8Dequantize:
    return Fp8Dequantize(SimpleNamespace(quantization_config=FineGrainedFP8Config()))


def _padded(x: torch.Tensor) -> torch.Tensor:
    """Zero-padded to multiples of 128 (DeepSeek-V3's partial blocks): transformers' quantizer
    and dequantizer take whole blocks only."""
    n, k = x.shape
    pad = (0, (-k) % 128, 0, (-n) % 128)
    if x.dtype == torch.float8_e4m3fn:
        return torch.nn.functional.pad(x.view(torch.uint8), pad).view(torch.float8_e4m3fn)
    return torch.nn.functional.pad(x, pad)


def tf_quantize(w: torch.Tensor, scale_fmt: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' (fp8 codes [N, K], weight_scale_inv) of a weight (edge blocks padded)."""
    out = quantizer(scale_fmt)._quantize_one("w.weight", _padded(w))
    q, s = out["w.weight"], out["w.weight_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn, "transformers left the weight unquantized"
    return q[: w.shape[0], : w.shape[1]].contiguous(), s


def tf_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 dequantization (edge blocks padded, then cropped)."""
    out = dequantizer()._dequantize_one(_padded(q), s, output_dtype=torch.float32)
    return out[: q.shape[0], : q.shape[1]].contiguous()


def write_fp8_checkpoint(
    path: Path,
    hf_config: dict = FULL,
    *,
    scale_fmt: str = "float",
    scale_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Path:
    """A tiny FP8 release at `path` (one model.safetensors, per-expert keys); scale_dtype:
    store the scales in this dtype (None: as transformers gives them, float32, or
    float8_e8m0fnu for ue8m0)."""
    model = build_model(hf_config, seed=seed)
    with torch.no_grad():  # a spread of magnitudes per block, as trained weights have
        gen = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.mul_(torch.exp(torch.randn(p.shape, generator=gen)))
    save_pretrained(model, path, "per_expert", dtype=torch.bfloat16, progress=False)
    tensors = load_file(path / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if QUANTIZED.fullmatch(key):
            q, s = tf_quantize(t, scale_fmt)
            out[key] = q
            out[key.removesuffix(".weight") + ".weight_scale_inv"] = (
                s if scale_dtype is None else s.to(torch.float32).to(scale_dtype)
            )
        else:
            out[key] = t
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        **({"scale_fmt": scale_fmt} if scale_fmt != "float" else {}),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
