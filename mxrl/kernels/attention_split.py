"""The split-keys paged attention's launcher (`paged_attention(..., split_keys=...)`): the split
kernel over chunks of query tiles whose fp32 scratch stays under `SCRATCH_BYTES`, then the
combine kernel (mxrl/kernels/triton_attention_split.py says how the bytes stay invariant)."""

from __future__ import annotations

import torch

from mxrl.kernels.attention import AttentionTiles, block_m

SCRATCH_BYTES = 64 << 20  # the splits' running states of one launch, at most


def split_step(split_blocks: int) -> int:
    """Cache blocks a step of the split kernel's online softmax: 4 where they divide a split
    (fewer, wider steps: on an H100 at 4,096 keys and 512-key splits the prototype's 4 blocks
    a step took 3-11% less than 1, docs/benchmarks.md), else 2, else 1. Fixed by the split's size alone, so a
    row's bytes still depend on nothing else (triton_attention_split.py)."""
    return next(s for s in (4, 2, 1) if split_blocks % s == 0)


def split_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    tiles: AttentionTiles,
    scale: float,
    fp8: bool,
    split_keys: int,
    max_keys: int,
) -> None:
    """Fill `out` [T, N, DV] (`paged_attention`'s other checks done): a launch of each kernel
    per chunk of tiles, every chunk the same size but the last."""
    import triton

    bs = k_cache.shape[1]
    if split_keys < 0 or split_keys % bs or max_keys < 1:
        raise ValueError(
            f"paged_attention: split_keys must be a positive multiple of the block size {bs} "
            f"and max_keys >= 1, got {split_keys} and {max_keys}"
        )
    split_blocks = split_keys // bs
    step = split_step(split_blocks)

    from mxrl.kernels.triton_attention_split import (
        combine_splits_kernel,
        paged_attention_split_kernel,
    )

    _, heads, d = q.shape
    heads_kv = k_cache.shape[2]
    dv = v_cache.shape[-1]
    group = heads // heads_kv
    rows, width_dk, width_dv = block_m(group), triton.next_power_of_2(d), triton.next_power_of_2(dv)
    splits = triton.cdiv(triton.cdiv(max_keys, bs), split_blocks)
    per_tile = heads_kv * splits * rows * (width_dv + 2) * 4
    chunk = max(1, SCRATCH_BYTES // per_tile)
    part = torch.empty(
        (min(chunk, tiles.num_tiles), heads_kv, splits, rows, width_dv + 2),
        dtype=torch.float32,
        device=q.device,
    )
    common = dict(G=group, BLOCK_DV=width_dv, BLOCK_M=rows, BLOCK_N=bs, HEADS_KV=heads_kv,
                  SPLIT=split_blocks)  # fmt: skip
    for start in range(0, tiles.num_tiles, chunk):
        stop = min(start + chunk, tiles.num_tiles)
        token, n_rows = tiles.token[start:stop], tiles.rows[start:stop]
        pos, req = tiles.pos[start:stop], tiles.req[start:stop]
        paged_attention_split_kernel[(stop - start, heads_kv, splits)](
            q, k_cache, v_cache, k_scale, v_scale, part, block_tables, token, n_rows, pos, req,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), scale, splits,
            DK=d, DV=dv, BLOCK_DK=width_dk, IEEE=q.dtype == torch.float32, FP8=fp8,
            HW=q.is_cuda, STEP=step, num_warps=4, **common,
        )  # fmt: skip
        combine_splits_kernel[(stop - start, heads_kv)](
            part, out, token, n_rows, pos, out.stride(0), out.stride(1), splits, DV=dv,
            num_warps=4, **common,
        )  # fmt: skip
