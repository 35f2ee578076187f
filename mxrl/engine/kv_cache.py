"""The paged KV cache and the engine's attention over a ragged batch.

Legend: N / K query / key-value heads (G = N / K queries per key head), D head dim, T new tokens
of the step, B block size (tokens per cache block), QT query tile.

`KVCache` holds, per layer, keys and values `[num_blocks, B, K, D]`; a sequence's tokens live in
the blocks of its block table (mxrl.engine.block_manager). Under a recipe's `kv_cache: fp8` they
are E4M3 codes with one fp32 scale per token slot and KV head `[num_blocks, B, K]`, written by the
one block-FP8 quantizer and read back as the compute dtype (`mxrl.nn.kv_quant`: the values the
trainer's attention sees too). `PagedAttention` is the forward
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

import logging
from typing import TYPE_CHECKING

import torch

from mxrl.engine.config import DEFAULT_CPU_KV_BYTES, CacheOptions
from mxrl.kernels.kv_write import fused_write_fits, write_kv_fp8
from mxrl.nn import invariant
from mxrl.nn.kv_quant import KV_CODE_DTYPE, KV_SCALE_DTYPE, dequantize_kv, quantize_kv

if TYPE_CHECKING:
    from mxrl.arch import ModelConfig
    from mxrl.kernels import Kernels
    from mxrl.kernels.attention import AttentionTiles

logger = logging.getLogger(__name__)

QUERY_TILE = 16
_GATHER_BYTES = 256 << 20  # keys and values gathered for one batch of tiles, at most


def cache_dims(c: ModelConfig) -> tuple[int, int, int]:
    """(heads, key dim, value dim) a token's cache entry holds per layer: K x D keys and values;
    for MLA (DeepSeek-V3) the expanded per-head keys (qk_nope + qk_rope) and values (v_head_dim)
    of all N heads, not DeepSeek's latent (docs/models.md compares the sizes)."""
    if c.is_mla:
        return c.num_attention_heads, c.qk_nope_head_dim + c.head_dim, c.v_head_dim
    return c.num_key_value_heads, c.head_dim, c.head_dim


class KVCache:
    """Keys and values of every layer, `[num_blocks, block_size, K, D]` and `[..., K, Dv]`
    (Dv = D but for MLA), zero-filled (a block's unwritten slots are multiplied by exact zeros,
    never by garbage). dtype: the compute dtype attention reads them in. fp8: held as E4M3 codes
    (`k`, `v`, uint8) with fp32 scales `[num_blocks, block_size, K]` (`k_scale`, `v_scale`),
    quantized on `backend`."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        v_head_dim: int | None = None,
        *,
        fp8: bool = False,
        backend: Kernels | None = None,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        v_shape = (*shape[:3], head_dim if v_head_dim is None else v_head_dim)
        self.block_size, self.dtype, self.fp8, self.backend = block_size, dtype, fp8, backend
        # keys per split of the Triton attention over this cache (the engine's attention_split;
        # 0: one pass): the kernel's step and graph launches read it here
        self.split_keys = 0
        held = KV_CODE_DTYPE if fp8 else dtype

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

        self.k, self.v = zeros(shape, held), zeros(v_shape, held)
        self.k_scale = self.v_scale = None
        if fp8:
            self.k_scale, self.v_scale = (
                zeros(shape[:-1], KV_SCALE_DTYPE),
                zeros(shape[:-1], KV_SCALE_DTYPE),
            )

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        v_head_dim: int | None = None,
        fp8: bool = False,
    ) -> int:
        """Keys and values of one block in every layer (fp8: a code byte per element and a
        4-byte scale per token slot and KV head, for keys and for values)."""
        dims = head_dim + (head_dim if v_head_dim is None else v_head_dim)
        if fp8:
            per_head = dims * KV_CODE_DTYPE.itemsize + 2 * KV_SCALE_DTYPE.itemsize
        else:
            per_head = dims * torch.empty((), dtype=dtype).element_size()
        return num_layers * block_size * num_kv_heads * per_head

    def write(self, layer: int, slots: torch.Tensor, k_KTD: torch.Tensor, v_KTD: torch.Tensor):
        """Store a step's keys and values (after RoPE, in the compute dtype) at their slots. An
        FP8 cache on the triton backend quantizes and stores each in one launch
        (`mxrl.kernels.kv_write`: the bytes of `quantize_kv` and the copies below)."""
        pairs = ((self.k, self.k_scale, k_KTD), (self.v, self.v_scale, v_KTD))
        for held, scales, x in pairs:
            nb, bs, heads_kv, d = held[layer].shape
            x_TKD = x.transpose(0, 1).to(self.dtype)
            if scales is None:
                held[layer].view(nb * bs, heads_kv, d).index_copy_(0, slots, x_TKD)
                continue
            codes_SKD, scales_SK = (
                held[layer].view(nb * bs, heads_kv, d),
                scales[layer].view(nb * bs, heads_kv),
            )
            if fused_write_fits(x_TKD, self.backend):  # one launch: quantized into the slots
                write_kv_fp8(x_TKD, slots, codes_SKD, scales_SK)
                continue
            codes, scale = quantize_kv(x_TKD, self.backend)
            codes_SKD.index_copy_(0, slots, codes)
            scales_SK.index_copy_(0, slots, scale)

    def gather(self, layer: int, values: bool, blocks: torch.Tensor) -> torch.Tensor:
        """Keys (values=False) or values of the cache blocks `blocks` (any index shape), as the
        compute dtype: `[*blocks.shape, B, K, D]`."""
        held = (self.v if values else self.k)[layer][blocks]
        if not self.fp8:
            return held
        scales = (self.v_scale if values else self.k_scale)[layer][blocks]
        return dequantize_kv(held, scales, self.dtype)

    @classmethod
    def allocate(
        cls,
        model_config: ModelConfig,
        cache_options: CacheOptions,
        device: torch.device,
        dtype: torch.dtype,
        scratch: int,
        *,
        fp8: bool = False,
        backend: Kernels | None = None,
    ) -> KVCache:
        """The cache `cache_options` sizes: `kv_cache_bytes`, or on CUDA `gpu_memory_fraction`
        of the memory free now, or on the CPU `DEFAULT_CPU_KV_BYTES`; as many whole blocks as
        fit, the last `scratch` of them held back (the CUDA graphs' padding rows write there).
        fp8: the recipe's `kv_cache: fp8` (quantized on `backend`)."""
        c, opt = model_config, cache_options
        heads, k_dim, v_dim = cache_dims(c)
        per_block = cls.bytes_per_block(
            c.num_hidden_layers, opt.block_size, heads, k_dim, dtype, v_dim, fp8
        )
        budget = opt.kv_cache_bytes
        if budget is None and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * opt.gpu_memory_fraction)
        elif budget is None:
            budget = DEFAULT_CPU_KV_BYTES
        num_blocks = budget // per_block - scratch
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of {opt.block_size} "
                f"tokens ({per_block} bytes) besides {scratch} scratch; raise "
                "kv_cache_bytes or gpu_memory_fraction"
            )
        cache = cls(
            c.num_hidden_layers, num_blocks + scratch, opt.block_size, heads, k_dim, dtype,
            device, v_dim, fp8=fp8, backend=backend,
        )  # fmt: skip
        logger.info(
            "engine: KV cache of %d blocks x %d tokens (%.1f MiB%s)",
            num_blocks, opt.block_size, num_blocks * per_block / 2**20, ", fp8" if fp8 else "",
        )  # fmt: skip
        return cache


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

    @classmethod
    def on_device(
        cls,
        cache: KVCache,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        tiles: AttentionTiles,
    ) -> PagedAttention:
        """The kernel's attention from metadata already on the device (a CUDA graph's static
        buffers: no host list, nothing to synchronise)."""
        self = cls.__new__(cls)
        self.cache, self.slot_mapping, self.requests = cache, slot_mapping, None
        self.kernel, self.block_tables, self.tiles = True, block_tables, tiles
        return self

    def __call__(
        self,
        layer_idx: int,
        q_NTD: torch.Tensor,
        k_KTD: torch.Tensor,
        v_KTD: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        cache = self.cache
        cache.write(layer_idx, self.slot_mapping, k_KTD, v_KTD)
        d = q_NTD.shape[-1]
        scale = d**-0.5 if scale is None else scale
        if self.kernel:
            from mxrl.kernels.attention import paged_attention

            q = q_NTD.transpose(0, 1).to(cache.dtype)  # [T, N, D]
            kc, vc = cache.k[layer_idx], cache.v[layer_idx]
            scales = (cache.k_scale[layer_idx], cache.v_scale[layer_idx]) if cache.fp8 else None
            # the most keys a request reads: what its block table can hold (a graph's width)
            max_keys = self.block_tables.shape[1] * cache.block_size
            o = paged_attention(q, kc, vc, self.block_tables, self.tiles, scale, scales,
                                split_keys=cache.split_keys, max_keys=max_keys)  # fmt: skip
            return o.transpose(0, 1).to(q_NTD.dtype)
        tiles = [
            (start + t0, min(QUERY_TILE, n - t0), kv_len - n + t0, table)
            for start, n, kv_len, table in self.requests
            for t0 in range(0, n, QUERY_TILE)
        ]
        return _attend(q_NTD.to(cache.dtype), cache, layer_idx, tiles, scale).to(q_NTD.dtype)


def _attend(
    q_NTD: torch.Tensor,
    cache: KVCache,
    layer: int,
    tiles: list[tuple[int, int, int, list[int]]],
    scale: float,
) -> torch.Tensor:
    """Causal attention of every query tile — (first token's index in T, rows, the first
    token's position, the request's block table) — over its request's cached keys; returns
    [N, T, D]. Tiles go in batches (bounded memory); within one, tiles are padded to QT rows and
    to the batch's number of key blocks (padding blocks are masked: exact zeros, module
    docstring), so each score and value GEMM is one `[G*QT, D] x [D, B]` / `[G*QT, B] x [B, D]`
    matrix of a batched matmul; the weighted values are summed block by block in q's dtype."""
    heads, num_tokens, d = q_NTD.shape
    _, bs, heads_kv, _ = cache.k[layer].shape
    dv = cache.v[layer].shape[-1]
    g = heads // heads_kv
    dev = q_NTD.device
    out = q_NTD.new_empty((heads, num_tokens, dv))
    per_tile_bytes = bs * heads_kv * (d + dv) * q_NTD.element_size()  # one key block, k and v
    start = 0
    while start < len(tiles):
        nb = 0
        end = start
        while end < len(tiles):  # grow the batch while its gathered keys stay within budget
            need = max(nb, (tiles[end][2] + tiles[end][1] - 1) // bs + 1)
            if end > start and (end + 1 - start) * need * per_tile_bytes > _GATHER_BYTES:
                break
            nb, end = need, end + 1
        batch = tiles[start:end]
        start = end
        p = len(batch)
        rows = torch.arange(QUERY_TILE, device=dev)
        first_t = torch.tensor([t[0] for t in batch], device=dev)
        first_pos = torch.tensor([t[2] for t in batch], device=dev)
        valid = rows[None, :] < torch.tensor([t[1] for t in batch], device=dev)[:, None]
        q_idx = torch.where(valid, first_t[:, None] + rows[None, :], first_t[:, None])
        q_pos = first_pos[:, None] + rows[None, :]  # [P, QT]
        tables = [t[3][:nb] + [0] * (nb - len(t[3][:nb])) for t in batch]
        blocks = torch.tensor(tables, device=dev)  # [P, nb]; padding blocks are masked
        q = q_NTD[:, q_idx].view(heads_kv, g, p, QUERY_TILE, d).permute(2, 0, 1, 3, 4)
        q = q.reshape(p * heads_kv, g * QUERY_TILE, d)
        keys = cache.gather(layer, False, blocks).permute(0, 3, 1, 2, 4)  # [P, K, nb, B, D]
        values = cache.gather(layer, True, blocks).permute(0, 3, 1, 2, 4)
        row_pos = q_pos[:, None, :].expand(p, g, QUERY_TILE).reshape(p, 1, g * QUERY_TILE, 1)
        key_pos = torch.arange(bs, device=dev)
        scores = []
        for b in range(nb):
            kb = keys[:, :, b].reshape(p * heads_kv, bs, d)
            s = (torch.bmm(q, kb.transpose(1, 2)) * scale).view(p, heads_kv, g * QUERY_TILE, bs)
            hidden = (b * bs + key_pos) > row_pos  # the future, padding slots and blocks
            scores.append(s.masked_fill(hidden, float("-inf")))
        m = scores[0].amax(-1)
        for s in scores[1:]:
            m = torch.maximum(m, s.amax(-1))
        denom = torch.zeros_like(m)
        acc = torch.zeros((p * heads_kv, g * QUERY_TILE, dv), dtype=q.dtype, device=dev)
        for b, s in enumerate(scores):
            e = invariant.exp(s - m[..., None])
            denom = denom + e.sum(-1)
            vb = values[:, :, b].reshape(p * heads_kv, bs, dv)
            acc = acc + torch.bmm(e.view(p * heads_kv, g * QUERY_TILE, bs), vb)
        o = acc.view(p, heads_kv, g * QUERY_TILE, dv) / denom[..., None]
        o = o.view(p, heads_kv, g, QUERY_TILE, dv).permute(1, 2, 0, 3, 4).reshape(heads, -1, dv)
        out[:, q_idx[valid]] = o[:, valid.reshape(-1)]
    return out
