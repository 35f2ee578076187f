"""Paged attention with the keys split at fixed positions (the engine's `attention_split`): more
programs at long contexts and few requests, where the one-pass kernel (triton_attention.py)
runs one program per query tile and KV head down 256 dependent block loads at 4k keys.

Legend as in triton_attention.py; S = SPLIT cache blocks a split (SPLIT * B keys).

Work split: one program per (query tile, KV head, split); split s walks the request's blocks
[s * S, (s + 1) * S) in order with the online softmax, STEP blocks a step (one key tile of
STEP * B keys: fewer dependent steps, wider dots; STEP = 1 is the one-pass kernel's walk), and
stores its running state (acc, m, l) in fp32. `combine_splits_kernel` merges a
tile's splits in split order from the first and normalises: m = max(m, m_s), acc = acc
e^(m - m_new) + acc_s e^(m_s - m_new), likewise l.

Why a row's bytes still depend on nothing but its query and its request's keys up to its
position (batch and chunk invariance, prefill and decode alike):
- where the splits and their steps fall is fixed by key positions, not by the batch or the
  tile: a row at position p has the splits 0 .. p // (S * B), each walked in steps of STEP
  blocks from its first (fixed shapes, fixed order, keys past the row masked to exact zeros);
- a tile holding rows at other positions may have one split, or one step, more than a row
  needs: that row has no key there; in a step its m stays, alpha = e^0 = 1 and p = 0 (exact
  no-ops), and a split of no key keeps the state m = -inf, l = 0, acc = 0, which the merge adds
  as e^-inf = 0 times it, multiplying by e^0 = 1: exact no-ops. Split 0 holds position 0, so m is finite
  from the first merge on.
The bytes are not the one-pass kernel's (another summation order); a recipe run that needs them
keeps the engine's default, `attention_split: 0`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxrl.kernels.triton_attention import attend_keys


@triton.jit
def paged_attention_split_kernel(
    q_ptr,  # [T, N, DK]
    k_cache_ptr,  # [num_blocks, B, K, DK] (FP8: uint8 E4M3 codes)
    v_cache_ptr,  # [num_blocks, B, K, DV]
    k_scale_ptr,  # FP8: fp32 [num_blocks, B, K], contiguous (else unused)
    v_scale_ptr,
    part_ptr,  # fp32 [tiles, K, SPLITS, BLOCK_M, BLOCK_DV + 2]: acc, then m and l
    block_tables_ptr,  # int32 [R, max_blocks]
    tile_token_ptr,  # int32 [tiles]: index in T of the tile's first token
    tile_rows_ptr,  # int32 [tiles]: tokens in the tile (<= QT)
    tile_pos_ptr,  # int32 [tiles]: position of the tile's first token in its request
    tile_req_ptr,  # int32 [tiles]: the request (row of block_tables)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    scale,
    SPLITS,  # splits a (tile, KV head) has room for in part_ptr (the grid's third dim)
    G: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
    HEADS_KV: tl.constexpr,
    HW: tl.constexpr,
    SPLIT: tl.constexpr,  # cache blocks a split holds
    STEP: tl.constexpr,  # cache blocks a step of the online softmax (divides SPLIT)
):
    tile = tl.program_id(0)
    head_kv = tl.program_id(1)
    split = tl.program_id(2)
    t0 = tl.load(tile_token_ptr + tile)
    rows = tl.load(tile_rows_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)
    req = tl.load(tile_req_ptr + tile)

    m_idx = tl.arange(0, BLOCK_M)
    qi = m_idx // G  # token of the tile
    head = head_kv * G + m_idx % G  # query head
    valid = qi < rows
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q_off = (t0 + qi)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + dk[None, :]
    q = tl.load(q_ptr + q_off, mask=valid[:, None] & (dk < DK)[None, :], other=0.0)
    q_pos = pos0 + qi

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    first = split * SPLIT
    end = tl.minimum((pos0 + rows - 1) // BLOCK_N + 1, first + SPLIT)
    kn = tl.arange(0, STEP * BLOCK_N)  # STEP cache blocks a step: one [STEP * B, DK] key tile
    slot = kn % BLOCK_N
    for b in range(first, end, STEP):
        blk = b + kn // BLOCK_N
        # a block past the tile's last (the last step of a split) is not in the block table,
        # which may end there: block 0 is read in its place, finite (the cache starts zeroed),
        # and its keys lie past every row's position, so the causal mask gives them p = 0
        inb = blk < end
        block = tl.load(block_tables_ptr + req * stride_bt + blk, mask=inb, other=0).to(tl.int64)
        k_off = block[:, None] * stride_kb + slot[:, None] * stride_ks + head_kv * stride_kh
        v_off = block[:, None] * stride_vb + slot[:, None] * stride_vs + head_kv * stride_vh
        s_off = (block * BLOCK_N + slot) * HEADS_KV + head_kv  # FP8 scales (else unused)
        m_i, l_i, acc = attend_keys(
            q, q_pos, b * BLOCK_N + kn, k_cache_ptr + k_off + dk[None, :],
            v_cache_ptr + v_off + dv[None, :], k_scale_ptr + s_off, v_scale_ptr + s_off,
            dk, dv, m_i, l_i, acc, scale, DK, DV, BLOCK_DK, BLOCK_DV, IEEE, FP8, HW, True,
        )  # fmt: skip
    w = BLOCK_DV + 2  # acc, m, l per row
    base = ((tile * HEADS_KV + head_kv) * SPLITS + split).to(tl.int64) * BLOCK_M * w
    tl.store(part_ptr + base + m_idx[:, None] * w + dv[None, :], acc)
    tl.store(part_ptr + base + m_idx * w + BLOCK_DV, m_i)
    tl.store(part_ptr + base + m_idx * w + BLOCK_DV + 1, l_i)


@triton.jit
def combine_splits_kernel(
    part_ptr,  # fp32 [tiles, K, SPLITS, BLOCK_M, BLOCK_DV + 2]
    o_ptr,  # [T, N, DV]
    tile_token_ptr,
    tile_rows_ptr,
    tile_pos_ptr,
    stride_ot,
    stride_oh,
    SPLITS,
    G: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEADS_KV: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """One program per (query tile, KV head): the tile's splits merged in order (module
    docstring), normalised and stored."""
    tile = tl.program_id(0)
    head_kv = tl.program_id(1)
    t0 = tl.load(tile_token_ptr + tile)
    rows = tl.load(tile_rows_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)
    splits = ((pos0 + rows - 1) // BLOCK_N) // SPLIT + 1
    w = BLOCK_DV + 2  # acc, m, l per row
    m_idx = tl.arange(0, BLOCK_M)
    dv = tl.arange(0, BLOCK_DV)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for s in range(0, splits):
        base = ((tile * HEADS_KV + head_kv) * SPLITS + s).to(tl.int64) * BLOCK_M * w
        acc_s = tl.load(part_ptr + base + m_idx[:, None] * w + dv[None, :])
        m_s = tl.load(part_ptr + base + m_idx * w + BLOCK_DV)
        l_s = tl.load(part_ptr + base + m_idx * w + BLOCK_DV + 1)
        m_new = tl.maximum(m, m_s)  # finite from split 0 on (it holds position 0)
        a = tl.exp(m - m_new)
        b = tl.exp(m_s - m_new)
        l_sum = l_sum * a + l_s * b
        acc = acc * a[:, None] + acc_s * b[:, None]
        m = m_new
    out = acc / l_sum[:, None]
    qi = m_idx // G
    head = head_kv * G + m_idx % G
    valid = qi < rows
    o_off = (t0 + qi)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + dv[None, :]
    o_mask = valid[:, None] & (dv < DV)[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=o_mask)
