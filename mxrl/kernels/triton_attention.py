"""Paged attention over a ragged batch, one launch per layer (prefill, chunked prefill and
decode alike), batch-invariant by construction.

Legend: T new tokens of the step, N / K query / key-value heads, G = N / K, DK / DV key and
value head dims (equal but for MLA, DeepSeek-V3's qk_nope + qk_rope keys and v_head_dim values),
B cache block size (= BLOCK_N), M = BLOCK_M rows of a program. A head dim that is not a power of
two (MLA's 192) is padded to the next one inside the kernel with masked loads: the padded query
and key columns are exact zeros, so every score is the unpadded dot's; padded value columns are
never stored.

Work split: one program per (query tile, key-value head). A query tile is up to QT = M / G
consecutive new tokens of one request; its rows are (token, query head of that KV head) pairs,
so GQA shares every key block load across the G heads. The program walks the request's keys
block by block through its block table, in order, with the online softmax.

Why a row's bytes depend on nothing but its query and its request's keys up to its position:
- a row of `tl.dot` is computed from that row alone (the MMA reduces over DK in an order fixed by
  the compiled kernel, whose shape — BLOCK_M, BLOCK_N, DK, DV, warps — never changes);
- key blocks are visited in one fixed order from position 0, the same for any tile or step;
- blocks past a row's position are masked to -inf: its running max stays, the rescale factor is
  exp(0) = 1 and the added terms are exact zeros, so how far the program walks (set by the last
  row of its tile) changes nothing.
The kernel agrees with the reference (`mxrl.engine.kv_cache`: two-pass softmax, exact exp) up to
floating-point rounding (exp2 approximation, summation order); tests state the bound.

FP8 cache (`FP8`, a recipe's `kv_cache: fp8`): the cache holds E4M3 bytes and one fp32 scale per
token slot and KV head; a loaded key or value is fl(fp32(code) * scale) cast to q's dtype, the
bytes `mxrl.nn.kv_quant.dequantize_kv` gives, so the kernel attends to exactly the values of the
reference's dequantized cache. On a GPU (`HW`) the codes are decoded by the hardware's E4M3
conversion, under the interpreter by integer arithmetic: the same exact values. The output equals
this kernel's output on a cache holding those values byte for byte with fp32 operands; with bf16
operands on a GPU, within one unit in the last place, as the compiler may choose another
tensor-core summation order for keys decoded in registers than for keys loaded from memory
(tests/kernels/test_attention_gpu.py). Either way one path per recipe: batch invariance holds.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxrl.kernels.triton_codecs import e4m3_decode


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [T, N, DK]
    k_cache_ptr,  # [num_blocks, B, K, DK] (FP8: uint8 E4M3 codes)
    v_cache_ptr,  # [num_blocks, B, K, DV]
    k_scale_ptr,  # FP8: fp32 [num_blocks, B, K], contiguous (else unused)
    v_scale_ptr,
    o_ptr,  # [T, N, DV]
    block_tables_ptr,  # int32 [R, max_blocks]
    tile_token_ptr,  # int32 [tiles]: index in T of the tile's first token
    tile_rows_ptr,  # int32 [tiles]: tokens in the tile (<= QT)
    tile_pos_ptr,  # int32 [tiles]: position of the tile's first token in its request
    tile_req_ptr,  # int32 [tiles]: the request (row of block_tables)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    scale,
    G: tl.constexpr,
    DK: tl.constexpr,  # key (and query) head dim
    DV: tl.constexpr,  # value head dim (DK but for MLA)
    BLOCK_DK: tl.constexpr,  # DK, or the next power of two (>= 16): the rest masked, exact zeros
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 operands: full-precision dot (no TF32)
    FP8: tl.constexpr,  # the cache holds E4M3 codes and scales
    HEADS_KV: tl.constexpr,
    HW: tl.constexpr,  # on a GPU: E4M3 decoded by the cvt instruction (exact, as the arithmetic)
):
    tile = tl.program_id(0)
    head_kv = tl.program_id(1)
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
    if BLOCK_DK == DK:
        q = tl.load(q_ptr + q_off, mask=valid[:, None], other=0.0)
    else:  # padded columns hold exact zeros: every score is the unpadded dot's
        q = tl.load(q_ptr + q_off, mask=valid[:, None] & (dk < DK)[None, :], other=0.0)
    q_pos = pos0 + qi

    n_idx = tl.arange(0, BLOCK_N)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    num_blocks = (pos0 + rows - 1) // BLOCK_N + 1
    for b in range(0, num_blocks):
        block = tl.load(block_tables_ptr + req * stride_bt + b).to(tl.int64)
        k_off = block * stride_kb + n_idx[:, None] * stride_ks + head_kv * stride_kh + dk[None, :]
        v_off = block * stride_vb + n_idx[:, None] * stride_vs + head_kv * stride_vh + dv[None, :]
        s_off = (block * BLOCK_N + n_idx) * HEADS_KV + head_kv  # FP8 scales (else unused)
        m_i, l_i, acc = attend_keys(
            q, q_pos, b * BLOCK_N + n_idx, k_cache_ptr + k_off, v_cache_ptr + v_off,
            k_scale_ptr + s_off, v_scale_ptr + s_off, dk, dv, m_i, l_i, acc, scale,
            DK, DV, BLOCK_DK, BLOCK_DV, IEEE, FP8, HW, False,
        )  # fmt: skip
    out = acc / l_i[:, None]
    o_off = (t0 + qi)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + dv[None, :]
    if BLOCK_DV == DV:
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=valid[:, None])
    else:
        o_mask = valid[:, None] & (dv < DV)[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def attend_keys(
    q, q_pos, k_pos, k_ptrs, v_ptrs, k_sf_ptrs, v_sf_ptrs, dk, dv, m_i, l_i, acc, scale,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IEEE: tl.constexpr, FP8: tl.constexpr, HW: tl.constexpr, EMPTY_ROWS: tl.constexpr,
):  # fmt: skip
    """One step of the online softmax, the one-pass and the split kernels' alike: a key tile
    (its rows at `k_ptrs` / `v_ptrs`, key positions `k_pos`; FP8: decoded and scaled as the
    module docstring says) attended by the query tile, keys past a row's position masked to
    -inf; returns the running (m, l, acc). EMPTY_ROWS: a row may have seen no key yet (a split
    past position 0), its state then stays exact zeros (no -inf - -inf)."""
    k_raw = load_cols(k_ptrs, dk, DK, BLOCK_DK)
    v_raw = load_cols(v_ptrs, dv, DV, BLOCK_DV)
    if FP8:
        k = (e4m3_values(k_raw, HW) * tl.load(k_sf_ptrs)[:, None]).to(q.dtype)
        v = (e4m3_values(v_raw, HW) * tl.load(v_sf_ptrs)[:, None]).to(q.dtype)
    else:
        k = k_raw
        v = v_raw
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if EMPTY_ROWS:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def load_cols(ptrs, cols, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """A cache block's rows: every column when the head dim is a power of two (the unmasked
    load the kernel always made), else its WIDTH columns and zeros up to BLOCK (an FP8 code 0
    decodes to +0: the padding is exact zeros either way)."""
    if BLOCK == WIDTH:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(cols < WIDTH)[None, :], other=0)


@triton.jit
def e4m3_values(codes, HW: tl.constexpr):
    """uint8 E4M3 codes -> their exact fp32 values. On a GPU the hardware conversion (sm_89+:
    one cvt per pair of bytes; every E4M3 value, subnormals included, is exact in fp16 and
    fp32); under the interpreter the integer decode of `triton_codecs` (the same values: its
    NaN for 0x7F / 0xFF too). The arithmetic decode costs ~15 integer operations an element,
    for every key and value of every block the kernel reads."""
    if HW:
        return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return e4m3_decode(codes.to(tl.int32))
