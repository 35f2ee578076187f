"""The causal LM shared by the trainer and the rollout engine, and its random initialisation.

Legend: B batch, S query length, L key/value length (S plus cached tokens), H hidden, V vocab,
k experts per token.

`CausalLM.state_dict()` keys are the canonical HF names of the fused expert layout, exactly as
`mxrl.arch.tensors_from_hf_config(config, "fused")` lists them (tied embeddings: no
`lm_head.weight`, the logits use `model.embed_tokens.weight`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from mxrl.arch.config import ModelConfig
from mxrl.models.layers import (
    DecoderLayer,
    KVCache,
    LayerInputs,
    RMSNorm,
    RotaryEmbedding,
    causal_mask,
)
from mxrl.models.mla import SigmoidRouter
from mxrl.nn import GroupedExperts


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(c, i, dtype=dtype) for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.rope_theta, dict(c.rope_scaling) or None)
        # recompute each decoder layer in the backward instead of keeping its activations
        # (training only; `CausalLM.set_training_options`)
        self.checkpoint_layers = False

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        replay_routing: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(final hidden states [B, S, H] after the norm, expert ids [B, S, k] per MoE layer).

        input_ids: int [B, S]. position_ids: int [B, S] (or [1, S]); default: arange(S), or the
        count of real tokens before each position when a 2-D attention_mask is given (left
        padding). Required with a kv_cache.
        attention_mask: [B, L] with 1 = token, 0 = padding (L = cached + new tokens), or bool
        [B, 1, S, L] with True = attend; None = causal.
        kv_cache: anything with `update(layer_idx, k, v) -> (k_all, v_all)` (see layers.KVCache).
        replay_routing: one int64 [B, S, k] tensor of expert ids per MoE layer, in layer order,
        to force those experts (routing replay); their weights come from this model's router
        probabilities.
        """
        B, S = input_ids.shape
        if kv_cache is not None and position_ids is None:
            raise ValueError(
                "position_ids is required with a kv_cache (the model cannot know how many tokens "
                "are cached); pass the absolute positions of the new tokens, [B, S]"
            )
        mask_BSL = _attention_mask(attention_mask, S, input_ids.device)
        if position_ids is None:
            position_ids = _default_positions(attention_mask, B, S, input_ids.device)
        moe_layers = [layer for layer in self.layers if layer.is_moe]
        if replay_routing is not None and len(replay_routing) != len(moe_layers):
            raise ValueError(
                f"replay_routing has {len(replay_routing)} tensors; the model has "
                f"{len(moe_layers)} MoE layers (one [B, S, k] tensor of expert ids per MoE layer)"
            )
        h = self.embed_tokens(input_ids)
        inputs = LayerInputs(
            self.rotary_emb(position_ids.expand(B, S), h.dtype), mask_BSL, kv_cache
        )
        routing: list[torch.Tensor] = []
        for layer in self.layers:
            replay = None
            if replay_routing is not None and layer.is_moe:
                replay = replay_routing[len(routing)]
            if self.checkpoint_layers and self.training and torch.is_grad_enabled():
                h, ids = torch.utils.checkpoint.checkpoint(
                    layer, h, inputs, replay, use_reentrant=False
                )
            else:
                h, ids = layer(h, inputs, replay)
            if ids is not None:
                routing.append(ids)
        return self.norm(h), routing


def _attention_mask(
    attention_mask: torch.Tensor | None, q_len: int, device: torch.device
) -> torch.Tensor | None:
    """A user mask -> bool [B, 1, S, L] (True = attend), or None for plain causal attention.

    2-D [B, L] (1/True = real token, 0 = padding; L covers cached + new tokens) is combined with
    the causal mask; 4-D bool [B, 1, S, L] is used as given.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:
        if attention_mask.dtype != torch.bool:
            raise ValueError("a 4-D attention_mask must be bool [B, 1, S, L] (True = attend)")
        return attention_mask
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be [B, L] (1 = token, 0 = padding) or bool [B, 1, S, L], "
            f"got shape {tuple(attention_mask.shape)}"
        )
    kv_len = attention_mask.shape[1]
    if kv_len < q_len:
        raise ValueError(f"attention_mask covers {kv_len} positions, fewer than the {q_len} inputs")
    causal = causal_mask(q_len, kv_len, device=device)
    mask = causal[None, None] & attention_mask.to(device=device, dtype=torch.bool)[:, None, None]
    # A padding query (left padding) sees no key at all, and SDPA turns an all-masked row into
    # NaN; let such a row see itself so its (ignored) output stays finite.
    own = torch.zeros_like(causal)
    own[torch.arange(q_len, device=device), torch.arange(kv_len - q_len, kv_len, device=device)] = (
        True
    )
    return mask | (own[None, None] & ~mask.any(dim=-1, keepdim=True))


def _default_positions(
    attention_mask: torch.Tensor | None, B: int, S: int, device: torch.device
) -> torch.Tensor:
    if attention_mask is not None and attention_mask.dim() == 2:
        # Count real tokens, so left-padded rows start at position 0 (as HF generate does).
        m = attention_mask.to(device=device, dtype=torch.int64)
        return (m.cumsum(-1) - 1).clamp(min=0)[:, -S:]
    return torch.arange(S, device=device)[None].expand(B, S)


class CausalLM(nn.Module):
    """Qwen3 / Qwen3-MoE / Qwen2-MoE / DeepSeek-V3 causal LM. Build with `build_model` or `from_pretrained`."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, dtype=dtype)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.compute_dtype: torch.dtype | None = None  # None: compute in the parameters' dtype

    def set_training_options(
        self,
        *,
        compute_dtype: torch.dtype | None = None,
        checkpoint_layers: bool = False,
        hold_bf16_weights: bool = False,
    ) -> None:
        """compute_dtype (e.g. torch.bfloat16): run forward under `torch.autocast` in that dtype,
        master weights unchanged (fp32 master, bf16 compute; the quantized ops keep their own
        numerics, docs/nn.md). checkpoint_layers: recompute each decoder layer in the backward
        (less activation memory, one more forward). hold_bf16_weights: the routed experts'
        grouped bf16 GEMMs cast each master once per optimizer step and hold the copy (2 bytes
        a weight) instead of casting it for every forward and dgrad (`GroupedExperts`; not
        under FSDP2, where it would hold whole unsharded weights). Defaults: none (the CPU
        reference)."""
        self.compute_dtype = compute_dtype
        self.model.checkpoint_layers = checkpoint_layers
        for module in self.modules():
            if isinstance(module, GroupedExperts):
                module.set_hold_bf16(hold_bf16_weights)

    @property
    def moe_layer_indices(self) -> list[int]:
        """Decoder layer index of each entry of the routing list."""
        return list(self.config.moe_layers)

    def autocast(self, device_type: str) -> torch.autocast:
        """The forward's autocast: `compute_dtype`, or off (the parameters' dtype)."""
        return torch.autocast(
            device_type,
            dtype=self.compute_dtype or torch.bfloat16,
            enabled=self.compute_dtype is not None,
        )

    def logits(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        """The lm_head on final hidden states (any leading shape), under the forward's autocast:
        what `forward` computes from what `forward(..., return_hidden=True)` returns (the
        trainer makes its logits a chunk of tokens at a time, mxrl.rl.logprobs)."""
        with self.autocast(hidden_BSH.device.type):
            if self.lm_head is None:
                return F.linear(hidden_BSH, self.model.embed_tokens.weight)
            return self.lm_head(hidden_BSH)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        return_routing: bool = False,
        return_hidden: bool = False,
        **inputs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits [B, S, V] in the model dtype; with `return_routing`, (logits, routing);
        with `return_hidden`, the final hidden states [B, S, H] instead of the logits (the
        lm_head left to `logits`: a caller that needs the logits of a few tokens at a time; a
        call of `forward` still, so FSDP2's hooks gather and free the parameters).

        inputs: `DecoderModel.forward`'s keywords (position_ids, attention_mask, kv_cache,
        replay_routing), passed on. routing: one int64 [B, S, k] tensor of chosen expert ids
        per MoE layer, in layer order (`moe_layer_indices`); empty for a dense model.
        """
        with self.autocast(input_ids.device.type):
            hidden, routing = self.model(input_ids, **inputs)
            out = hidden if return_hidden else self.logits(hidden)
        return (out, routing) if return_routing else out


@torch.no_grad()
def init_weights(model: CausalLM, seed: int | None = None) -> None:
    """Normal(0, initializer_range) for every matmul weight and the embedding, zero biases, unit
    norms. Values are drawn on the CPU in fp32 (then cast and copied), so one seed gives the same
    model on every device and the same values, rounded, in every dtype."""
    std = model.config.initializer_range
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def normal_(p: torch.Tensor) -> None:
        p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, nn.Linear):
            normal_(module.weight)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            normal_(module.weight)
        elif isinstance(module, SigmoidRouter):
            normal_(module.weight)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, GroupedExperts):
            normal_(module.gate_up_proj)
            normal_(module.down_proj)


def build_model(
    config: ModelConfig | Mapping[str, Any] | str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int | None = None,
) -> CausalLM:
    """A randomly initialised model (see `init_weights`); `config` is a ModelConfig or anything
    `ModelConfig.from_hf` reads. Without a seed, torch's global RNG is used."""
    if not isinstance(config, ModelConfig):
        config = ModelConfig.from_hf(config)
    model = empty_model(config, dtype=dtype, device=device)
    init_weights(model, seed)
    return model


def empty_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> CausalLM:
    """The model with uninitialised storage: built on the meta device, then allocated once on
    `device` (no throw-away init of a large model)."""
    with torch.device("meta"):
        model = CausalLM(config, dtype=dtype)
    return model.to_empty(device=device)
