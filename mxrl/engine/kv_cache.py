"""The paged KV cache and the engine's attention over a ragged batch.

Legend: N / K query / key-value heads (G = N / K queries per key head), D head dim, T new tokens
of the step, B block size (tokens per cache block), QT query tile.

`KVCache` holds, per layer, keys and values `[num_blocks, B, K, D]`; a sequence's tokens live in
the blocks of its block table (mxrl.engine.block_manager). `PagedAttention` is the forward
context's attention for one step: it writes the step's keys/values to their slots, then attends
every request's new tokens to exactly that request's keys.

Invariant by construction (docs/engine.md, "Batch invariance"): a query's output depends only on
its own vector and its request's keys up to its position — not on the batch, nor on how the
request's tokens were split into chunks or steps (prefill, chunked prefill, decode and prefix
sharing all give the same bytes). Queries go in tiles of exactly QT rows (zero-padded) and keys
in whole cache blocks, so every score and value GEMM has one fixed shape `[G*QT, D] x [D, B]`,
`[G*QT, B] x [B, D]`; the softmax is two-pass over the blocks in order — the exact max first,
then `exp` (mxrl.nn.invariant) and sums added block by block. Blocks past a query's position
add exact zeros, so where the step's tile or chunk ends does not matter.
"""

from __future__ import annotations

import torch

from mxrl.nn import invariant

QUERY_TILE = 16


class KVCache:
    """Keys and values of every layer, `[num_blocks, block_size, K, D]` each, zero-filled (a
    block's unwritten slots are multiplied by exact zeros, never by garbage)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element


class PagedAttention:
    """The `RaggedAttention` of one step (mxrl.models.context).

    slot_mapping: int64 [T], the cache slot (block * B + offset) of every new token.
    requests: per request (first new token's index in T, number of new tokens, keys in the
    cache after this step, block table). kernel: attend with the Triton kernel
    (`mxrl.kernels.attention`, one launch per layer; the engine's triton backend) instead of the
    reference below (the CPU path).
    """

    def __init__(
        self,
        cache: KVCache,
        slot_mapping: torch.Tensor,
        requests: list[tuple[int, int, int, list[int]]],
        *,
        group: int = 1,
        kernel: bool = False,
    ) -> None:
        self.cache, self.slot_mapping, self.requests = cache, slot_mapping, requests
        self.kernel = kernel
        if kernel:
            from mxrl.kernels.attention import attention_tiles

            device = slot_mapping.device
            width = max(len(r[3]) for r in requests)
            tables = [r[3] + [0] * (width - len(r[3])) for r in requests]
            self.block_tables = torch.tensor(tables, dtype=torch.int32, device=device)
            self.tiles = attention_tiles([r[:3] for r in requests], group, device)

    def __call__(
        self, layer_idx: int, q_NTD: torch.Tensor, k_KTD: torch.Tensor, v_KTD: torch.Tensor
    ) -> torch.Tensor:
        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]
        nb, bs, heads_kv, d = kc.shape
        kc.view(nb * bs, heads_kv, d)[self.slot_mapping] = k_KTD.transpose(0, 1).to(kc.dtype)
        vc.view(nb * bs, heads_kv, d)[self.slot_mapping] = v_KTD.transpose(0, 1).to(vc.dtype)
        if self.kernel:
            from mxrl.kernels.attention import paged_attention

            q = q_NTD.transpose(0, 1).to(kc.dtype)  # [T, N, D]
            o = paged_attention(q, kc, vc, self.block_tables, self.tiles, d**-0.5)
            return o.transpose(0, 1).to(q_NTD.dtype)
        out = torch.empty_like(q_NTD)
        for start, n, kv_len, table in self.requests:
            blocks = torch.tensor(table[: -(-kv_len // bs)], device=kc.device)
            keys = kc[blocks].permute(2, 0, 1, 3)  # [K, blocks, B, D]
            values = vc[blocks].permute(2, 0, 1, 3)
            q = q_NTD[:, start : start + n].to(kc.dtype)
            o = _attend(q, keys, values, kv_len - n, kv_len)
            out[:, start : start + n] = o.to(out.dtype)
        return out


def _attend(
    q_NnD: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int, kv_len: int
) -> torch.Tensor:
    """Causal attention of n queries at positions first_pos.. over `kv_len` keys held in
    blocks `[K, blocks, B, D]`; returns [N, n, D] (module docstring: the fixed-shape order)."""
    heads, n, d = q_NnD.shape
    heads_kv, _, bs, _ = keys.shape
    g = heads // heads_kv
    scale = d**-0.5
    key_pos = torch.arange(bs, device=q_NnD.device)
    out = torch.empty_like(q_NnD)
    for t0 in range(0, n, QUERY_TILE):
        rows = min(QUERY_TILE, n - t0)
        tile = q_NnD.new_zeros((heads, QUERY_TILE, d))
        tile[:, :rows] = q_NnD[:, t0 : t0 + rows]
        tile = tile.view(heads_kv, g * QUERY_TILE, d)
        q_pos = first_pos + t0 + torch.arange(QUERY_TILE, device=q_NnD.device)
        q_pos = q_pos.repeat(g)  # [G*QT]: the tile's rows per query head of a key head
        last = min(first_pos + t0 + rows - 1, kv_len - 1)
        scores = []
        for b in range(last // bs + 1):
            s = torch.bmm(tile, keys[:, b].transpose(1, 2)) * scale  # [K, G*QT, B]
            hidden = (b * bs + key_pos)[None, :] > q_pos[:, None]  # the future; padding slots
            scores.append(s.masked_fill(hidden[None], float("-inf")))
        m = scores[0].amax(-1)
        for s in scores[1:]:
            m = torch.maximum(m, s.amax(-1))
        denom = torch.zeros_like(m)
        acc = torch.zeros((heads_kv, g * QUERY_TILE, d), dtype=q_NnD.dtype, device=q_NnD.device)
        for b, s in enumerate(scores):
            p = invariant.exp(s - m[..., None])
            denom = denom + p.sum(-1)
            acc = acc + torch.bmm(p, values[:, b])
        o = (acc / denom[..., None]).view(heads, QUERY_TILE, d)
        out[:, t0 : t0 + rows] = o[:, :rows]
    return out
