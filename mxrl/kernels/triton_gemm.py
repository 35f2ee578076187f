"""Low-bit weight GEMM (Triton): y = lp(x) @ lp(w)^T in fp32, times the decode global scales.

The exact emulation of a block-scaled GEMM (docs/design.md §2,
`mxrl.nn.paths.reference.emulated_matmul`) with both operands read in their packed form
(4.5 / 8.25 bits per weight) and decoded in registers:
  lp NVFP4  = E2M1 * E4M3 block scale (16 along K)
  lp MXFP8  = E4M3 * 2^(E8M0 code - 127) (32 along K)
  y[m, n]   = fl( sum_k lp_x[m, k] * lp_w[n, k]  *  fl(s_x[m] * s_w[n]) )
s = fl(1 / S_enc) (NVFP4 only; per token or per tensor for x, per tensor / expert / row for w).
Every product lp_x * lp_w is exact, so only the order (and, on tensor cores, the rounding) of
the fp32 sum differs from the reference: `mxrl.kernels.decode_gemm.error_bound` is the bound.

How each format reaches the tensor cores (constexprs; sm_90 has no FP4 or MX instructions):
- NVFP4: lp = e2m1 * s_block has at most 6 significant bits in [2^-10, 2688]: an exact normal
  fp16. NV_ASM: NVFP4_DECODE_ASM decodes four code bytes per call (shifts and masks build the
  E4M3 image of each E2M1 code, the hardware cvt makes it fp16, one f16x2 multiply applies the
  block scale); otherwise the same bytes one at a time with Triton ops. Even (low-nibble) and
  odd (high-nibble) elements come out as two [R, BK/2] halves and feed two dots (even K, odd
  K): the same sum, with no interleaving shuffle. fp16 dot, fp32 accumulation.
- MXFP8, BLOCK_M <= 32 (MX_BLOCK_DOT): one fp16 dot per 32-element scale block on the E4M3
  values themselves (exact in fp16), its fp32 sum multiplied by 2^(kx[m] + kw[n]) (exact) and
  added to the accumulator. Larger BLOCK_M: lp = e4m3 * 2^k in fp32, fed as bf16 (4 significant
  bits: exact unless |lp| < 2^-126, i.e. E8M0 codes near 0, where bf16's subnormals are shorter
  than fp32's).
- DOT_IEEE: fp32 operands, input_precision="ieee" (FMA, IEEE adds; slow, for checks).
- Under Triton's interpreter (HW False) the decoding runs without the hardware cvt and the dots
  in fp32 (the interpreter's bf16 dot multiplies raw bit patterns).

Grid: axis 0 = (N tile, K split), axis 1 = M tile (dense) or expert slot (grouped). Weights are
read once per M tile (decode: one M tile). With SPLIT_K > 1 each program writes its fp32 partial
[BLOCK_M, BLOCK_N] tile to a workspace; the last program of a tile (a per-tile counter, atomic
acq_rel at GPU scope after a CTA barrier) sums the partials in split order 0, 1, ..., S-1 (read
from L2 with ld.global.cg) and writes y, then resets the counter to 0 for the next launch. The
result is deterministic and independent of which program finishes last. Grouped: expert slot i
runs the i-th expert with rows (offsets[e+1] > offsets[e]); slots past the last active expert
do nothing.

Legend: T rows of x (tokens, sorted by expert when grouped), N output features, K reduction,
E experts. x codes [T, K/2 | K], x block scales [T, K/16 | K/32], w codes [E, N, K/2 | K],
w scales [E, N, K/16 | K/32] (E = 1 dense); all dense row-major (the launcher checks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from mxrl.kernels.backend import launcher
from mxrl.kernels.triton_codecs import FMT_MXFP8, FMT_NVFP4
from mxrl.kernels.triton_gemm_decode import mxfp8_values, nvfp4_halves
from mxrl.kernels.triton_gemm_tiles import (  # noqa: F401  (split_k_counters: the launchers')
    find_group,
    load_codes,
    mxfp8_block_dots,
    split_k_counters,
    store_y,
    tile_dot,
)

FMT_CODES = {"mxfp8": FMT_MXFP8.value, "nvfp4": FMT_NVFP4.value}
# elements per stored byte and per block scale
ELEMS_PER_BYTE = {0: 1, 1: 2}
SCALE_BLOCK = {0: 32, 1: 16}
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["T", "E"])
def _low_bit_gemm_kernel(
    xq_ptr,
    xs_ptr,
    xgs_ptr,
    xgs_stride,
    wq_ptr,
    ws_ptr,
    wgs_ptr,
    wgs_stride_e,
    wgs_stride_n,
    offs_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    xq_stride,
    xs_stride,
    wq_stride_e,
    wq_stride,
    ws_stride_e,
    ws_stride,
    T,
    N,
    K,
    E,
    K_PER_SPLIT,
    FMT: tl.constexpr,
    GROUPED: tl.constexpr,
    HAS_GS: tl.constexpr,
    HW: tl.constexpr,
    NV_ASM: tl.constexpr,
    MX_BLOCK_DOT: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    DOT_FMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    MASK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    REDUCE: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    EPB: tl.constexpr = 2 if FMT == FMT_NVFP4 else 1  # elements per code byte
    SB: tl.constexpr = 16 if FMT == FMT_NVFP4 else 32  # elements per block scale
    pid_ns = tl.program_id(0)
    pid_g = tl.program_id(1)
    n_tile = pid_ns // SPLIT_K
    split = pid_ns % SPLIT_K
    if GROUPED:
        e, row_lo, row_hi = find_group(offs_ptr, pid_g, E, E_POW2)
    else:
        e = pid_g * 0
        row_lo = pid_g * BLOCK_M
        row_hi = tl.minimum(row_lo + BLOCK_M, T)

    if row_hi > row_lo:
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = cols < N
        e64 = e.to(tl.int64)
        wq_base = wq_ptr + e64 * wq_stride_e
        ws_base = ws_ptr + e64 * ws_stride_e
        wgs_base = wgs_ptr + e64 * wgs_stride_e
        k_lo = split * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        for m0 in range(row_lo, row_hi, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            m_mask = rows < row_hi
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                if FMT == FMT_MXFP8 and MX_BLOCK_DOT:
                    acc = mxfp8_block_dots(
                        acc, xq_ptr, xs_ptr, xq_stride, xs_stride, rows, m_mask,
                        wq_base, ws_base, wq_stride, ws_stride, cols, n_mask, k0, k_hi,
                        HW, DOT_IEEE, MASK_N, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
                    )  # fmt: skip
                else:
                    xq, xs = load_codes(
                        xq_ptr, xs_ptr, xq_stride, xs_stride, rows, m_mask, k0, k_hi,
                        EPB, SB, True, EVEN_K, BLOCK_K,
                    )  # fmt: skip
                    wq, ws = load_codes(
                        wq_base, ws_base, wq_stride, ws_stride, cols, n_mask, k0, k_hi,
                        EPB, SB, MASK_N, EVEN_K, BLOCK_K,
                    )  # fmt: skip
                    if FMT == FMT_NVFP4:
                        x_even, x_odd = nvfp4_halves(xq, xs, BLOCK_M, BLOCK_K, HW, NV_ASM)
                        w_even, w_odd = nvfp4_halves(wq, ws, BLOCK_N, BLOCK_K, HW, NV_ASM)
                        acc = tile_dot(acc, x_even, w_even, HW, DOT_IEEE, DOT_FMA)
                        acc = tile_dot(acc, x_odd, w_odd, HW, DOT_IEEE, DOT_FMA)
                    else:
                        xv = mxfp8_values(xq, xs, BLOCK_M, BLOCK_K, HW)
                        wv = mxfp8_values(wq, ws, BLOCK_N, BLOCK_K, HW)
                        acc = tile_dot(acc, xv, wv, HW, DOT_IEEE, DOT_FMA)
            if SPLIT_K == 1:
                store_y(
                    acc, rows, m_mask, cols, n_mask, y_ptr, N, xgs_ptr, xgs_stride, wgs_base,
                    wgs_stride_n, HAS_GS, HW,
                )  # fmt: skip
            else:
                p_ptrs = part_ptr + (split.to(tl.int64) * T + rows[:, None]) * N + cols[None, :]
                tl.store(p_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])

        if SPLIT_K > 1 and REDUCE:
            # Every thread's partial stores precede the (one-thread, acq_rel, GPU-scope) counter
            # increment; the last program of the tile then reads all partials from L2 (.cg).
            tl.debug_barrier()
            tile = pid_g * tl.cdiv(N, BLOCK_N) + n_tile
            done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT_K - 1:
                for m0 in range(row_lo, row_hi, BLOCK_M):
                    rows = m0 + tl.arange(0, BLOCK_M)
                    m_mask = rows < row_hi
                    mask = m_mask[:, None] & n_mask[None, :]
                    offs = rows[:, None] * N + cols[None, :]
                    total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
                    for s in range(1, SPLIT_K):  # in split order (not unrolled)
                        p_ptrs = part_ptr + (s * T).to(tl.int64) * N + offs  # T may be a constant
                        total += tl.load(p_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                    store_y(
                        total, rows, m_mask, cols, n_mask, y_ptr, N, xgs_ptr, xgs_stride, wgs_base,
                        wgs_stride_n, HAS_GS, HW,
                    )  # fmt: skip
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


# --- launcher ------------------------------------------------------------------------------------


def _u8(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.uint8:
        raise TypeError(f"mxrl::low_bit_gemm: {what} must be uint8 codes, got {t.dtype}")
    return t.contiguous()


def _gs_f32(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.float32:
        raise TypeError(f"mxrl::low_bit_gemm: {what} must be float32, got {t.dtype}")
    return t.contiguous()


@triton_op("mxrl::low_bit_gemm", mutates_args={"counters"})
def low_bit_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    xgs: torch.Tensor | None,
    wq: torch.Tensor,
    ws: torch.Tensor,
    wgs: torch.Tensor | None,
    offsets: torch.Tensor | None,
    counters: torch.Tensor,
    fmt: int,
    out_dtype: torch.dtype,
    block_m: int,
    block_n: int,
    block_k: int,
    split_k: int,
    num_slots: int,
    num_warps: int,
    num_stages: int,
    dot_ieee: bool,
    hw: bool,
    nv_asm: bool,
    dot_fma: bool = False,
) -> torch.Tensor:
    """y [T, N] of `out_dtype` (module docstring). Codes and scales as uint8 (QTensor fields
    viewed as bytes), S_enc fp32: xgs [] or [T, 1], wgs [] / [N, 1] (dense) or [] / [E, 1, 1] /
    [E, N, 1] (grouped, offsets [E+1] given). num_slots: grid rows over experts (grouped).
    hw: compiled for the GPU (False: Triton's interpreter); nv_asm: NVFP4 decoded by the inline
    PTX (NVFP4_DECODE_ASM; GPU only), else by Triton ops (same values); dot_fma: the CUDA-core
    dot (any block_m >= 1) instead of the tensor cores (block_m >= 16)."""
    y, _ = launch_low_bit_gemm(
        xq, xs, xgs, wq, ws, wgs, offsets, counters, fmt, out_dtype, block_m, block_n, block_k,
        split_k, num_slots, num_warps, num_stages, dot_ieee, hw, nv_asm, reduce=True,
        dot_fma=dot_fma,
    )  # fmt: skip
    return y


def launch_low_bit_gemm(
    xq, xs, xgs, wq, ws, wgs, offsets, counters, fmt, out_dtype, block_m, block_n, block_k,
    split_k, num_slots, num_warps, num_stages, dot_ieee, hw, nv_asm, *, reduce=True,
    dot_fma=False,
):  # fmt: skip
    """The kernel launch behind `mxrl::low_bit_gemm`; reduce=False (tests) skips the in-kernel
    split-K reduction and returns the partials workspace [S, T, N] as well."""
    grouped, has_gs = offsets is not None, fmt == FMT_CODES["nvfp4"]
    xq, xs, xgs, xgs_stride, wq, ws, wgs, wgs_stride_e, wgs_stride_n, offsets, (t, k, e, n) = (
        _check_low_bit_gemm_args(xq, xs, xgs, wq, ws, wgs, offsets, fmt, out_dtype)
    )
    y, part, k_per_split, split_k = _workspace(t, n, k, split_k, block_k, out_dtype, xq.device)
    if t == 0 or n == 0:
        return y, part
    if k == 0:
        return y.zero_(), part
    n_tiles = triton.cdiv(n, block_n)
    slots = num_slots if grouped else triton.cdiv(t, block_m)
    if split_k > 1 and reduce and counters.numel() < slots * n_tiles:
        raise ValueError(f"mxrl::low_bit_gemm: {slots * n_tiles} split-K counters needed")
    launcher(_low_bit_gemm_kernel, xq)[(n_tiles * split_k, slots)](
        xq,
        xs,
        xgs,
        xgs_stride,
        wq,
        ws,
        wgs,
        wgs_stride_e,
        wgs_stride_n,
        offsets,
        y,
        part,
        counters,
        xq.stride(0),
        xs.stride(0),
        wq.stride(0) if grouped else 0,
        wq.stride(-2),
        ws.stride(0) if grouped else 0,
        ws.stride(-2),
        t,
        n,
        k,
        e,
        k_per_split,
        FMT=fmt,
        GROUPED=grouped,
        HAS_GS=has_gs,
        HW=hw,
        NV_ASM=hw and nv_asm and fmt == FMT_CODES["nvfp4"],
        MX_BLOCK_DOT=fmt == FMT_CODES["mxfp8"] and 16 <= block_m <= 32 and not dot_fma,
        DOT_IEEE=dot_ieee,
        DOT_FMA=dot_fma,
        EVEN_K=k % block_k == 0,
        MASK_N=n % block_n != 0,
        SPLIT_K=split_k,
        REDUCE=reduce,
        E_POW2=max(16, triton.next_power_of_2(e)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y, part


def _check_low_bit_gemm_args(xq, xs, xgs, wq, ws, wgs, offsets, fmt, out_dtype):
    """`launch_low_bit_gemm`'s operands checked (in this order) and made ready for the kernel:
    codes and scales contiguous uint8; the global scales fp32 with their strides (a dummy
    buffer, stride 0, for mxfp8); offsets contiguous (the x codes when dense: never read).
    Returns (xq, xs, xgs, xgs_stride, wq, ws, wgs, wgs_stride_e, wgs_stride_n, offsets,
    (T, K, E, N))."""
    if fmt not in ELEMS_PER_BYTE:
        raise ValueError(f"mxrl::low_bit_gemm: fmt code {fmt} is not one of {FMT_CODES}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"mxrl::low_bit_gemm: out_dtype must be one of {OUT_DTYPES}")
    epb, sb = ELEMS_PER_BYTE[fmt], SCALE_BLOCK[fmt]
    xq, xs, wq, ws = (
        _u8(xq, "x codes"),
        _u8(xs, "x scales"),
        _u8(wq, "w codes"),
        _u8(ws, "w scales"),
    )
    grouped = offsets is not None
    if xq.dim() != 2 or wq.dim() != (3 if grouped else 2):
        raise ValueError(
            f"mxrl::low_bit_gemm: x codes must be 2-D and w codes {3 if grouped else 2}-D, got "
            f"{tuple(xq.shape)} and {tuple(wq.shape)}"
        )
    t, k = xq.shape[0], xq.shape[1] * epb
    e = wq.shape[0] if grouped else 1
    n = wq.shape[-2]
    if wq.shape[-1] * epb != k or xs.shape != (t, k // sb) or ws.shape != (*wq.shape[:-1], k // sb):
        raise ValueError(
            f"mxrl::low_bit_gemm: shapes do not fit: x codes {tuple(xq.shape)}, x scales "
            f"{tuple(xs.shape)}, w codes {tuple(wq.shape)}, w scales {tuple(ws.shape)}"
        )
    has_gs = fmt == FMT_CODES["nvfp4"]
    if has_gs != (xgs is not None and wgs is not None):
        raise ValueError("mxrl::low_bit_gemm: nvfp4 needs both global scales, mxfp8 neither")
    dev = xq.device
    if has_gs:
        xgs = _gs_f32(xgs, "x global scale")
        if xgs.numel() not in (1, t) or (xgs.dim() and xgs.shape != (t, 1)):
            raise ValueError(
                f"mxrl::low_bit_gemm: x global scale {tuple(xgs.shape)} != [] / [T, 1]"
            )
        xgs_stride = 0 if xgs.dim() == 0 else 1
        wgs = _gs_f32(wgs, "w global scale")
        if wgs.dim() == 0:
            wgs_stride_e = wgs_stride_n = 0
        else:
            lead = tuple(wq.shape[:-1])
            ok = wgs.dim() == len(lead) + 1 and wgs.shape[-1] == 1
            ok = ok and all(a in (1, b) for a, b in zip(wgs.shape[:-1], lead, strict=True))
            if not ok:
                raise ValueError(
                    f"mxrl::low_bit_gemm: w global scale {tuple(wgs.shape)} does not fit weights "
                    f"{tuple(wq.shape[:-1])} (want [], [N, 1], [E, 1, 1] or [E, N, 1])"
                )
            strides = wgs.expand(*lead, 1).stride()
            wgs_stride_e = strides[0] if grouped else 0
            wgs_stride_n = strides[-2]
    else:
        xgs = wgs = torch.empty(1, dtype=torch.float32, device=dev)
        xgs_stride = wgs_stride_e = wgs_stride_n = 0
    if grouped:
        if offsets.shape != (e + 1,) or offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"mxrl::low_bit_gemm: expert offsets must be int32/int64 of shape [E + 1] = "
                f"[{e + 1}], got {offsets.dtype} {tuple(offsets.shape)}"
            )
        offsets = offsets.contiguous()
    else:
        offsets = xq  # never read (GROUPED False): any pointer
    return xq, xs, xgs, xgs_stride, wq, ws, wgs, wgs_stride_e, wgs_stride_n, offsets, (t, k, e, n)


def _workspace(t, n, k, split_k, block_k, out_dtype, dev):
    """The output y [T, N], the split-K partials [S, T, N] (a [1] placeholder without split-K),
    K per split (whole blocks) and the split count S that leaves no split empty."""
    y = torch.empty((t, n), dtype=out_dtype, device=dev)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split) if k else 1
    part = torch.empty((split_k, t, n) if split_k > 1 else (1,), dtype=torch.float32, device=dev)
    return y, part, k_per_split, split_k
