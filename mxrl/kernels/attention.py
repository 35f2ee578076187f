"""`paged_attention`: the engine's attention over a ragged batch in one Triton launch per layer
(mxrl/kernels/triton_attention.py says how it stays batch-invariant). The reference — and the
CPU path — is `mxrl.engine.kv_cache` (two-pass softmax over the same key blocks).

    tiles = attention_tiles(requests, num_q_heads // num_kv_heads, device)
    out = paged_attention(q_TND, k_cache, v_cache, block_tables, tiles, scale)

Legend: T new tokens, N / K query / key-value heads, D head dim, R requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS_PER_PROGRAM = 16  # BLOCK_M: (token, query head) rows of one program, fixed (see kernel)


@dataclass(frozen=True)
class AttentionTiles:
    """The query tiles of one step, int32 [tiles] each: first token (index in T), tokens, the
    first token's position in its request, the request (row of the block tables)."""

    token: torch.Tensor
    rows: torch.Tensor
    pos: torch.Tensor
    req: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return int(self.token.shape[0])


def block_m(group: int) -> int:
    """Rows of a program for `group` query heads per key-value head (a power of two >= 16)."""
    m = ROWS_PER_PROGRAM
    while m < group:
        m *= 2
    return m


def attention_tiles(
    requests: list[tuple[int, int, int]], group: int, device: torch.device | str
) -> AttentionTiles:
    """Tiles for requests given as (first token index in T, new tokens, keys after the step):
    consecutive new tokens of one request, `block_m(group) // group` per tile."""
    per_tile = block_m(group) // group
    token, rows, pos, req = [], [], [], []
    for r, (start, n, kv_len) in enumerate(requests):
        first = kv_len - n
        for t in range(0, n, per_tile):
            token.append(start + t)
            rows.append(min(per_tile, n - t))
            pos.append(first + t)
            req.append(r)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return AttentionTiles(as_t(token), as_t(rows), as_t(pos), as_t(req))


def paged_attention(
    q_TND: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    tiles: AttentionTiles,
    scale: float,
    fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    split_keys: int = 0,
    max_keys: int = 0,
) -> torch.Tensor:
    """Causal attention of every new token over its request's cached keys (already written).

    k_cache [num_blocks, B, K, DK], v_cache [num_blocks, B, K, DV] (B a power of two >= 16; the
    head dims any width >= 16, DV = DK but for MLA); block_tables int32 [R, max_blocks]; q
    [T, N, DK] in the cache's dtype. fp8_scales: an FP8 cache (k_cache and v_cache uint8 E4M3
    codes) and its (key, value) scales, fp32 [num_blocks, B, K], contiguous; q is then in the
    dtype the cache is read as. split_keys: 0, the one-pass kernel; else the keys split every
    `split_keys` positions (a multiple of B; mxrl/kernels/triton_attention_split.py: other
    bytes, batch-invariant), `max_keys` the most keys a request of the step holds (it sizes
    the splits' scratch). Returns [T, N, DV]."""
    import triton

    from mxrl.kernels.triton_attention import paged_attention_kernel

    _, heads, d = q_TND.shape
    _, bs, heads_kv, d_cache = k_cache.shape
    dv = v_cache.shape[-1]
    if heads % heads_kv or d != d_cache or v_cache.shape[:-1] != k_cache.shape[:-1]:
        raise ValueError(
            f"paged_attention: q {tuple(q_TND.shape)} does not fit the cache "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} ([T, N, DK] with N a multiple of "
            f"K, keys [..., K, DK], values [..., K, DV])"
        )
    if fp8_scales is not None:
        k_scale, v_scale = fp8_scales
        want = k_cache.shape[:-1]
        ok = all(s.shape == want and s.dtype == torch.float32 and s.is_contiguous()
                 for s in fp8_scales)  # fmt: skip
        if k_cache.dtype != torch.uint8 or v_cache.dtype != torch.uint8 or not ok:
            raise ValueError(
                f"paged_attention: an FP8 cache is uint8 codes {tuple(k_cache.shape)} with "
                f"contiguous fp32 scales {tuple(want)}, got {k_cache.dtype} / {v_cache.dtype} "
                f"and {[(tuple(s.shape), s.dtype) for s in fp8_scales]}"
            )
    elif q_TND.dtype != k_cache.dtype:
        raise ValueError(f"paged_attention: q is {q_TND.dtype}, the cache {k_cache.dtype}")
    else:
        k_scale = v_scale = k_cache  # unused
    if bs < 16 or bs & (bs - 1) or d < 16 or dv < 16:
        raise ValueError(
            f"paged_attention needs a power-of-two block size >= 16 and head dims >= 16, got "
            f"{bs}, {d} / {dv}"
        )
    group = heads // heads_kv
    q = q_TND.contiguous()
    out = q.new_empty((q.shape[0], heads, dv))
    if tiles.num_tiles == 0:
        return out
    if split_keys:
        from mxrl.kernels.attention_split import split_attention

        split_attention(q, k_cache, v_cache, k_scale, v_scale, out, block_tables, tiles, scale,
                        fp8_scales is not None, split_keys, max_keys)  # fmt: skip
        return out
    paged_attention_kernel[(tiles.num_tiles, heads_kv)](
        q, k_cache, v_cache, k_scale, v_scale, out, block_tables,
        tiles.token, tiles.rows, tiles.pos, tiles.req,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        scale,
        G=group, DK=d, DV=dv, BLOCK_DK=triton.next_power_of_2(d),
        BLOCK_DV=triton.next_power_of_2(dv), BLOCK_M=block_m(group), BLOCK_N=bs,
        IEEE=q.dtype == torch.float32, FP8=fp8_scales is not None, HEADS_KV=heads_kv,
        HW=q.is_cuda, num_warps=4,
    )  # fmt: skip
    return out
