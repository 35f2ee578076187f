"""One forward step of the engine over a ragged batch: each request feeds its new tokens (a whole
prompt at prefill, one token at decode); tokens of all requests are concatenated (no padding).

Legend: T new tokens of all requests, H hidden, N/K query/kv heads, D head dim, L cached length.
The model's own modules do the math (norms, projections, router, experts); this file only
orders them for a flattened batch with a per-request KV cache: token-parallel ops run on fixed
tiles (`modules.tiled`), attention runs request by request on exactly that request's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mxrl.engine.modules import tiled
from mxrl.models import CausalLM, causal_mask
from mxrl.models.layers import SparseMoeBlock, apply_rope
from mxrl.nn import invariant


@dataclass
class RequestCache:
    """Keys/values of one request, per layer: [K, capacity, D], filled up to `length`."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def allocate(cls, model: CausalLM, capacity: int, device, dtype) -> RequestCache:
        c = model.config
        shape = (c.num_key_value_heads, capacity, c.head_dim)
        n = c.num_hidden_layers
        return cls(
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)],
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)],
        )


def forward_step(
    model: CausalLM, tokens: list[torch.Tensor], caches: list[RequestCache], tile: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Feed `tokens[r]` (int64 [S_r]) to request r, whose cache holds its earlier tokens.

    Returns (logits of each request's last new token [R, V] fp32, routing: per request int64
    [num_moe_layers, S_r, k] expert ids, or [0, S_r, 0] for a dense model). Advances the caches.
    """
    c = model.config
    lengths = [int(t.shape[0]) for t in tokens]
    starts = [cache.length for cache in caches]
    ids = torch.cat(tokens)
    positions = torch.cat(
        [torch.arange(s, s + n, device=ids.device) for s, n in zip(starts, lengths, strict=True)]
    )
    net = model.model
    h = net.embed_tokens(ids)
    cos, sin = net.rotary_emb(positions[None], h.dtype)  # [1, T, D]
    routing: list[torch.Tensor] = []
    for layer in net.layers:
        attn = layer.self_attn
        x = tiled(layer.input_layernorm, h, tile)
        q = tiled(attn.q_proj, x, tile).view(-1, attn.num_heads, attn.head_dim)
        k = tiled(attn.k_proj, x, tile).view(-1, attn.num_kv_heads, attn.head_dim)
        v = tiled(attn.v_proj, x, tile).view(-1, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None:
            q, k = tiled(attn.q_norm, q, tile), tiled(attn.k_norm, k, tile)
        q = apply_rope(q.transpose(0, 1)[None], cos, sin)[0]  # [N, T, D]
        k = apply_rope(k.transpose(0, 1)[None], cos, sin)[0]  # [K, T, D]
        v = v.transpose(0, 1)
        out = torch.empty_like(q)
        offset = 0
        for r, (cache, n) in enumerate(zip(caches, lengths, strict=True)):
            s = starts[r]
            cache.keys[layer.layer_idx][:, s : s + n] = k[:, offset : offset + n]
            cache.values[layer.layer_idx][:, s : s + n] = v[:, offset : offset + n]
            keys = cache.keys[layer.layer_idx][:, : s + n]
            vals = cache.values[layer.layer_idx][:, : s + n]
            mask = causal_mask(n, s + n, device=q.device) if n > 1 else None
            out[:, offset : offset + n] = F.scaled_dot_product_attention(
                q[None, :, offset : offset + n],
                keys[None],
                vals[None],
                attn_mask=mask,
                enable_gqa=True,
            )[0]
            offset += n
        h = h + tiled(attn.o_proj, out.transpose(0, 1).reshape(ids.shape[0], -1), tile)
        x = tiled(layer.post_attention_layernorm, h, tile)
        if isinstance(layer.mlp, SparseMoeBlock):
            mlp_out, chosen = _moe(layer.mlp, x, tile)
            routing.append(chosen)
        else:
            mlp_out = tiled(layer.mlp, x, tile)
        h = h + mlp_out
    for cache, n in zip(caches, lengths, strict=True):
        cache.length += n
    last = torch.tensor(lengths, device=ids.device).cumsum(0) - 1
    h_last = tiled(net.norm, h, tile)[last]
    logits = tiled(model.logits, h_last, tile).float()
    per_request = _split_routing(routing, lengths, c.num_experts_per_tok)
    return logits, per_request


def _moe(block: SparseMoeBlock, x_TH: torch.Tensor, tile: int):
    routed = [block.route(chunk) for chunk in _chunks(x_TH, tile)]
    ids_Tk = torch.cat([r[0] for r in routed])[: x_TH.shape[0]]
    weights_Tk = torch.cat([r[1] for r in routed])[: x_TH.shape[0]]
    out = block.experts(x_TH, ids_Tk, weights_Tk)
    if block.shared_expert is not None:
        gate = invariant.sigmoid(tiled(block.shared_expert_gate, x_TH, tile))
        out = out + gate * tiled(block.shared_expert, x_TH, tile)
    return out, ids_Tk


def _chunks(x: torch.Tensor, tile: int) -> list[torch.Tensor]:
    pad = (-x.shape[0]) % tile
    if pad or x.shape[0] == 0:
        x = torch.cat([x, x.new_zeros((pad or tile, *x.shape[1:]))])
    return list(x.split(tile))


def _split_routing(routing: list[torch.Tensor], lengths: list[int], k: int) -> list[torch.Tensor]:
    if not routing:
        return [torch.zeros((0, n, 0), dtype=torch.int64) for n in lengths]
    stacked = torch.stack(routing)  # [num_moe, T, k]
    return [part.cpu() for part in stacked.split(lengths, dim=1)]
