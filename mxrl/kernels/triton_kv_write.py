"""The FP8 KV cache's write (Triton): a step's keys or values quantized to E4M3 and stored at
their cache slots in one launch. Each (token, head) vector of `D` elements is one block-FP8
block `1 x D` (docs/recipes.md, "The KV cache"), with the 1 x bk kernel's arithmetic (its
`block_decode_scale`, mxrl/kernels/triton_fp8_block.py) and so its bytes:
  a = max(amax over the finite elements, 1e-4);  sf = fl(a / 448)
  q = E4M3_satfinite(fl(x * fl(1 / sf)))  (NaN/±Inf -> 0x7F);  stored scale = sf (fp32)

Legend: x_TKD [T, K, D] (any strides but a unit one along D), slots int64 [T] (the rows of the
cache's [blocks * block_size, K, D] view), codes u8 [S, K, D] and scales fp32 [S, K] contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxrl.kernels.backend import launcher
from mxrl.kernels.triton_codecs import e4m3_encode_masked, finite_amax, is_finite
from mxrl.kernels.triton_fp8_block import block_decode_scale

ROWS = 16  # (token, head) vectors per program


@triton.jit(do_not_specialize=["N", "stride_t", "stride_h"])
def kv_write_fp8_kernel(
    x_ptr,
    stride_t,
    stride_h,
    slot_ptr,
    q_ptr,
    s_ptr,
    N,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    HW: tl.constexpr,
    ROWS: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # row r: token r // HEADS, head r % HEADS
    valid = r < N
    t = r // HEADS
    h = r % HEADS
    cols = tl.arange(0, D)
    src = t.to(tl.int64) * stride_t + h * stride_h
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
    x = x.to(tl.float32)
    sf, _ = block_decode_scale(finite_amax(x, 1), False)  # fp32 scales: no E4M3 cap below 448
    rcp = tl.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf)
    q = e4m3_encode_masked(x * rcp[:, None], is_finite(x), HW)
    slot = tl.load(slot_ptr + t, mask=valid, other=0).to(tl.int64)
    dest = slot * HEADS + h
    tl.store(q_ptr + dest[:, None] * D + cols[None, :], q, mask=valid[:, None])
    tl.store(s_ptr + dest, sf, mask=valid)


def launch_kv_write_fp8(
    x_TKD: torch.Tensor, slots: torch.Tensor, codes_SKD: torch.Tensor, scales_SK: torch.Tensor
) -> None:
    """Quantize x_TKD's vectors and store them at `slots` of codes_SKD / scales_SK."""
    t, heads, d = x_TKD.shape
    n = t * heads
    if n == 0:
        return
    grid = (triton.cdiv(n, ROWS),)
    launcher(kv_write_fp8_kernel, x_TKD)[grid](
        x_TKD,
        x_TKD.stride(0),
        x_TKD.stride(1),
        slots,
        codes_SKD,
        scales_SK,
        n,
        HEADS=heads,
        D=d,
        HW=x_TKD.is_cuda,
        ROWS=ROWS,
        num_warps=4,
    )
