"""Block-FP8 GEMM on Hopper tensor cores through `torch._scaled_mm` (spec §5.4).

    y [M, N] = x [M, K] @ w [N, K]^T   with x quantized 1x128 (per token) and w 128x128, both
    `mxrl.formats` fp8_block QTensors (E4M3 bytes, fp32 *decode* scales).

cuBLASLt (SM90, torch >= 2.10) takes the scales as BlockWise1x128 for A — shape [M, K/128],
M-major (strides (1, M)) — and, for B = w^T given column-major, BlockWise128x128 — the weight's
[N/128, K/128] scale, transposed (a view) — or BlockWise1x128 (w a second 1x128 operand, as in
a weight gradient) — [K/128, N], N-major (what its runtime check asks; torch's meta kernel
describes another layout). It accumulates in fp32 with its own summation order and rounds the
output to `out_dtype`: not bit-identical to the emulated fp32 GEMM
(`dequantize(x) @ dequantize(w).T`), within the bound its test states (Hopper's FP8 MMA
accumulates with reduced precision between fp32 promotions, plus the output rounding).
Blackwell has native MX/NV GEMMs instead; nothing here was run on Blackwell.
"""

from __future__ import annotations

import torch

from mxrl.formats import QTensor
from mxrl.formats.constants import Format

BLOCK = 128
WGRAD_PROGRAMS = 4 * 132  # about four waves of an H200's 132 SMs


def fp8_block_matmul(
    xq: QTensor, wq: QTensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """x (1x128 fp8_block QTensor [M, K]) times w (fp8_block QTensor [N, K], 128x128 blocks —
    a weight — or 1x128 — a second activation, as in the weight gradient dy^T x, both quantized
    along the tokens) transposed, on a CUDA device with FP8 tensor cores (sm_90)."""
    if xq.fmt is not Format.FP8_BLOCK or wq.fmt is not Format.FP8_BLOCK:
        raise ValueError(f"fp8_block_matmul takes fp8_block QTensors, got {xq.fmt} and {wq.fmt}")
    if xq.block != (1, BLOCK) or wq.block not in ((BLOCK, BLOCK), (1, BLOCK)):
        raise ValueError(
            f"fp8_block_matmul needs x in 1x128 and w in 128x128 or 1x128 blocks, got "
            f"{xq.block} and {wq.block}; quantize with block=(1, 128) or block=(128, 128)"
        )
    if len(xq.shape) != 2 or len(wq.shape) != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(f"shapes {tuple(xq.shape)} @ {tuple(wq.shape)}^T do not fit")
    if not xq.qdata.is_cuda:
        raise ValueError("fp8_block_matmul runs on CUDA (sm_90); use the emulated GEMM on the CPU")
    m, n, k = xq.shape[0], wq.shape[0], xq.shape[1]
    b_rowwise = wq.block == (1, BLOCK)
    if (n % BLOCK and not b_rowwise) or k % BLOCK:
        raise ValueError(f"N={n} and K={k} must be multiples of {BLOCK}")
    # On the H200 with torch 2.11, cuBLASLt gave silently wrong results (0.9 relative error)
    # when K/128 or N/128 was not a multiple of 4 (spec §5.4 warns of the K case); M is padded
    # to 4 as well, as its scale layout asks; N of a 1x128 w to 16 (mat2's dims must divide
    # by 16). Pad with zeros (data) and ones (scales), slice.
    mp, kp = _up(m, 4), _up(k, 4 * BLOCK)
    np_ = _up(n, 16) if b_rowwise else _up(n, 4 * BLOCK)
    a = _pad2(xq.qdata, mp, kp).view(torch.float8_e4m3fn)
    b = _pad2(wq.qdata, np_, kp).view(torch.float8_e4m3fn).t()  # [K, N], column-major
    sa = _pad2(xq.scale, mp, kp // BLOCK, value=1.0)
    scale_a = sa.t().contiguous().t()  # [M, K/128], M-major
    if b_rowwise:  # [K/128, N], N-major (cuBLASLt's runtime check; not the meta kernel's)
        scale_b = _pad2(wq.scale, np_, kp // BLOCK, value=1.0).t().contiguous()
    else:  # [K/128, N/128] view of the [N/128, K/128] weight scale
        scale_b = _pad2(wq.scale, np_ // BLOCK, kp // BLOCK, value=1.0).t()
    y = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return y[:m, :n] if (mp, np_) != (m, n) else y


def grouped_fp8_block_reference(
    xq: QTensor, wq: QTensor, expert_offsets: torch.Tensor
) -> torch.Tensor:
    """fp32 y [R, N]: per expert e, `dequantize(x[rows of e]) @ dequantize(w[e]).T` (the
    emulated GEMM of the contract)."""
    from mxrl.formats import dequantize

    x = dequantize(xq)
    w = dequantize(wq)
    y = torch.zeros((x.shape[0], w.shape[-2]), dtype=torch.float32, device=x.device)
    bounds = expert_offsets.tolist()
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y[lo:hi] = x[lo:hi] @ w[e].T
    return y


def grouped_fp8_block_matmul(
    xq: QTensor,
    wq: QTensor,
    expert_offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    block_m: int = 16,
    block_n: int = 64,
    transpose_w: bool = False,
    fp8_mma: bool = False,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Routed experts' block-FP8 GEMM in one launch (mxrl/kernels/triton_fp8_block_gemm.py):
    x (1x128 QTensor [R, K], rows sorted by expert) times w[e] (128x128 QTensor [E, N, K])
    transposed for the rows expert_offsets[e]:expert_offsets[e + 1] (int32 [E + 1], on the
    device: no host sync). A fixed (block_m, block_n) gives batch-invariant rows.

    transpose_w: x [R, N] times w[e] itself (the experts' dgrad, y [R, K]): the kernel reads
    the same codes and scales through transposed strides (a square block of w^T is a block of
    w: `mxrl.formats.fp8_block.transpose_square_blocks`), so no transposed copy is written.
    fp8_mma: each 128-wide block's product on the FP8 tensor cores (Hopper's FP8 MMA, reduced
    accumulation precision inside the block, promoted to fp32 per block) instead of the fp16
    MMA on the decoded codes; its bound is docs/kernels.md's."""
    from mxrl.kernels import triton_fp8_block_gemm as kern

    if xq.fmt is not Format.FP8_BLOCK or wq.fmt is not Format.FP8_BLOCK:
        raise ValueError(
            f"grouped_fp8_block_matmul takes fp8_block QTensors, got {xq.fmt}, {wq.fmt}"
        )
    if xq.block != (1, BLOCK) or wq.block != (BLOCK, BLOCK) or len(wq.shape) != 3:
        raise ValueError(
            f"grouped_fp8_block_matmul needs x [R, K] in 1x128 blocks and w [E, N, K] in "
            f"128x128 blocks, got {xq.block} {tuple(xq.shape)} and {wq.block} {tuple(wq.shape)}"
        )
    e, n, k = wq.shape
    if transpose_w:
        n, k = k, n
    if len(xq.shape) != 2 or xq.shape[1] != k:
        raise ValueError(f"shapes {tuple(xq.shape)} @ {tuple(wq.shape)}^T do not fit")
    if expert_offsets.shape != (e + 1,) or expert_offsets.device != xq.device:
        raise ValueError(f"expert_offsets must be [E + 1] = [{e + 1}] on {xq.device}")
    if BLOCK % block_n or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_n must divide {BLOCK} and block_m be a power of two >= 16")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    r = xq.shape[0]
    y = torch.empty((r, n), dtype=out_dtype, device=xq.device)
    if r == 0:
        return y
    if transpose_w and (n % BLOCK or k % BLOCK):
        raise ValueError(f"transpose_w needs whole 128x128 weight blocks, got {tuple(wq.shape)}")
    xs, ws = xq.scale.contiguous(), wq.scale.contiguous()
    xd, wd = xq.qdata.contiguous(), wq.qdata.contiguous()
    # strides of the weight's (output feature, reduction) dims, codes and block scales
    w_n, w_k = (wd.stride(2), wd.stride(1)) if transpose_w else (wd.stride(1), wd.stride(2))
    s_n, s_k = (ws.stride(2), ws.stride(1)) if transpose_w else (ws.stride(1), ws.stride(2))
    grid = (-(-n // block_n), max(1, min(e, r)))
    kern.fp8_block_grouped_kernel[grid](
        xd, xs, wd, ws, expert_offsets.to(torch.int32), y,
        xd.stride(0), xs.stride(0), wd.stride(0), w_n, w_k, ws.stride(0), s_n, s_k,
        y.stride(0), n, k, e,
        HW=xd.is_cuda, OUT_BF16=out_dtype == torch.bfloat16,
        E_POW2=max(2, 1 << (e - 1).bit_length()), BLOCK_M=block_m, BLOCK_N=block_n,
        FP8_MMA=fp8_mma, num_warps=num_warps, **_stages(num_stages),
    )  # fmt: skip
    return y


def grouped_fp8_block_wgrad_reference(
    aq: QTensor, bq: QTensor, expert_offsets: torch.Tensor
) -> torch.Tensor:
    """fp32 dW [E, N, K]: per expert e, `dequantize(a)[:, rows of e] @ dequantize(b)[:, rows
    of e].T` (the emulated GEMM of the contract); a = dy^T [N, R], b = x^T [K, R]."""
    from mxrl.formats import dequantize

    a, b = dequantize(aq), dequantize(bq)
    bounds = expert_offsets.tolist()
    out = torch.zeros((len(bounds) - 1, a.shape[0], b.shape[0]), dtype=torch.float32)
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[e] = a[:, lo:hi] @ b[:, lo:hi].T
    return out.to(a.device)


def grouped_fp8_block_wgrad(
    aq: QTensor,
    bq: QTensor,
    expert_offsets: torch.Tensor,
    *,
    block_n: int = 64,
    block_k: int = 64,
    fp8_mma: bool = False,
    num_warps: int = 4,
    num_stages: int | None = None,
    runs: int | None = None,
) -> torch.Tensor:
    """The routed experts' block-FP8 weight gradient in one launch, a GEMM grouped along its
    reduction (mxrl/kernels/triton_fp8_block_gemm.py, `fp8_block_kgrouped_kernel`):
    dW[e] [N, K] = dy_e^T x_e, from a = dy^T [N, R] and b = x^T [K, R], both quantized 1x128
    along R (the tokens, sorted by expert), where expert e owns columns
    expert_offsets[e]:expert_offsets[e + 1] — every offset a multiple of 128, so no 128-token
    block straddles two experts (zero-pad each expert's tokens: zeros change no block's amax and
    add nothing). int32 [E + 1] offsets on the device: no host sync. fp32 output; an expert
    without tokens gets zeros. fp8_mma as in `grouped_fp8_block_matmul`. The experts' weight
    gradient of the fp8-block quantized backward (`mxrl.nn.paths.grouped`).
    runs: how many runs of consecutive experts the programs split the experts into (each
    program streams one run's token blocks for one output tile); default: enough programs for
    about four waves of the GPU. An expert's bytes do not depend on it."""
    for name, q in (("dy^T", aq), ("x^T", bq)):
        if q.fmt is not Format.FP8_BLOCK or q.block != (1, BLOCK) or len(q.shape) != 2:
            raise ValueError(
                f"grouped_fp8_block_wgrad: {name} must be a 2-D fp8_block QTensor in 1x128 "
                f"blocks along the tokens, got {q.fmt} {q.block} {tuple(q.shape)}"
            )
    (n, r), (k, r_b) = aq.shape, bq.shape
    e = expert_offsets.shape[0] - 1
    if r != r_b or r % BLOCK:
        raise ValueError(
            f"grouped_fp8_block_wgrad: dy^T {tuple(aq.shape)} and x^T {tuple(bq.shape)} must "
            f"hold the same tokens, a multiple of {BLOCK} (each expert's zero-padded)"
        )
    if e < 1 or expert_offsets.device != aq.device:
        raise ValueError(f"expert_offsets must be [E + 1] on {aq.device}")
    if not expert_offsets.is_cuda and bool((expert_offsets % BLOCK).any()):
        raise ValueError(f"every expert offset must be a multiple of {BLOCK}: {expert_offsets}")
    from mxrl.kernels import triton_fp8_block_gemm as kern

    y = torch.empty((e, n, k), dtype=torch.float32, device=aq.device)
    tiles = -(-n // block_n) * -(-k // block_k)
    # enough programs to fill the GPU: the experts split into runs, one program per (tile, run)
    runs = max(1, min(e, runs or -(-WGRAD_PROGRAMS // tiles)))
    per_run = -(-e // runs)
    grid = (-(-n // block_n), -(-k // block_k), -(-e // per_run))
    ad, bd = aq.qdata.contiguous(), bq.qdata.contiguous()
    a_s, b_s = aq.scale.contiguous(), bq.scale.contiguous()
    kern.fp8_block_kgrouped_kernel[grid](
        ad, a_s, bd, b_s, expert_offsets.to(torch.int32), y,
        ad.stride(0), a_s.stride(0), bd.stride(0), b_s.stride(0), y.stride(0), y.stride(1),
        n, k, e, per_run, HW=ad.is_cuda, BLOCK_N=block_n, BLOCK_K=block_k, FP8_MMA=fp8_mma,
        E_POW2=max(2, 1 << (e - 1).bit_length()), num_warps=num_warps, **_stages(num_stages),
    )  # fmt: skip
    return y


def _stages(num_stages: int | None) -> dict:
    """Triton's software-pipelining depth where given (its default otherwise)."""
    return {} if num_stages is None else {"num_stages": num_stages}


def _up(v: int, multiple: int) -> int:
    return -(-v // multiple) * multiple


def _pad2(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    if tuple(t.shape) == (rows, cols):
        return t
    out = torch.full((rows, cols), value, dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out
