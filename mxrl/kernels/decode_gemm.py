"""GEMMs with low-bit weights for rollout (decode): NVFP4 and MXFP8, dense and grouped experts.

    from mxrl.kernels.decode_gemm import low_bit_linear, grouped_low_bit_linear
    y = low_bit_linear(x, wq)                        # x [..., K] bf16/fp32, wq QTensor [N, K]
    y = grouped_low_bit_linear(x_sorted, wq, offs)   # x [T, K] sorted by expert, wq [E, N, K],
                                                     # offs [E+1]: expert e owns rows offs[e]:offs[e+1]

Semantics: the emulated GEMM of `mxrl.kernels.emulated` (docs/design.md §2), the one formula
the trainer's `mxrl.nn.paths.reference.emulated_matmul` computes too:
  xq = quantize(x, fmt, per_token=...)               same bytes as the trainer's activations
  y  = fl( (lp(xq) @ lp(wq)^T)_fp32  *  fl(s_x * s_w) )
lp = dequantized without NVFP4's FP32 global scale (exact in fp32, and in the fp16 / bf16 the
tensor cores take), s = fl(1 / S_enc)
(NVFP4 only: s_x per token [T, 1] or per tensor, s_w per tensor, expert or row). Grouped:
expert e's rows use expert e's weight and scale, as the engine's per-expert calls do.

Backends (chosen once, `mxrl.kernels.select_backend`): "reference" is that formula in PyTorch
(any device: the CPU path and the test oracle); "triton" reads the weight codes and scales
(4.5 or 8.25 bits per weight) and dequantizes them in registers (`triton_gemm.py`). The products
are exact on both; the fp32 sums run in another order, so the two agree within
`error_bound(xq, wq)`:
  |y - y_ref| <= BOUND_ULPS * K * 2^-24 * (|lp_x| @ |lp_w|^T) * |s_x * s_w|
(4 K fp32 half-ulps of the sum of absolute products: both sides' summation errors, at most
K * 2^-24 each for IEEE adds and 2 K * 2^-24 for the tensor cores' truncating fp32 accumulation,
plus the scale and output roundings). Inputs whose sums are exact in any order give identical
bits (tested). A bf16/fp16 output adds its own rounding of y.

Legend: T rows (tokens), K reduction, N output features, E experts.
"""

from __future__ import annotations

import itertools

import torch

from mxrl.formats import QTensor, decode_global_scale, dequantize
from mxrl.formats.constants import Format
from mxrl.kernels.api import quantize as kernel_quantize
from mxrl.kernels.backend import Backend, Kernels, backend_for
from mxrl.kernels.decode_gemm_config import GemmConfig, choose_config, default_config
from mxrl.kernels.emulated import emulated_gemm

__all__ = [
    "BOUND_ULPS",
    "GemmConfig",
    "choose_config",
    "default_config",
    "error_bound",
    "grouped_low_bit_linear",
    "grouped_low_bit_matmul",
    "low_bit_linear",
    "low_bit_matmul",
    "reference_low_bit_matmul",
]

BOUND_ULPS = 4
GEMM_FORMATS = (Format.NVFP4, Format.MXFP8)


def low_bit_linear(
    x: torch.Tensor,
    wq: QTensor,
    *,
    act_per_token: bool = True,
    out_dtype: torch.dtype | None = None,
    backend: Kernels | Backend | str | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] through the weight wq (QTensor [N, K], nvfp4 or mxfp8): the
    activation is quantized per the plan (MXFP8 1x32; NVFP4 per token, or per tensor with
    act_per_token=False), then `low_bit_matmul`. out_dtype defaults to x's dtype."""
    _check_weight(wq, 2)
    chosen = backend_for(backend, x.device, "rollout_gemm")
    lead = x.shape[:-1]
    xq = _quantize_activation(x.reshape(-1, x.shape[-1]), wq, act_per_token, chosen)
    y = low_bit_matmul(xq, wq, out_dtype=out_dtype or x.dtype, backend=chosen, config=config)
    return y.reshape(*lead, wq.shape[0])


def grouped_low_bit_linear(
    x_sorted: torch.Tensor,
    wq: QTensor,
    expert_offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    backend: Kernels | Backend | str | None = None,
    config: GemmConfig | None = None,
    active_experts: int | None = None,
) -> torch.Tensor:
    """y [T, N] for rows x_sorted [T, K] grouped by expert (expert e owns rows
    expert_offsets[e]:expert_offsets[e+1], offsets [E+1] int32/int64 on x's device, last = T)
    through the per-expert weights wq (QTensor [E, N, K]), one launch for all experts. NVFP4
    activations get per-token scales (routed experts, docs/design.md §1). active_experts: expected
    number of experts with rows, a performance hint only (default min(E, T))."""
    _check_weight(wq, 3)
    chosen = backend_for(backend, x_sorted.device, "rollout_gemm")
    xq = _quantize_activation(x_sorted, wq, True, chosen)
    return grouped_low_bit_matmul(
        xq,
        wq,
        expert_offsets,
        out_dtype=out_dtype or x_sorted.dtype,
        backend=chosen,
        config=config,
        active_experts=active_experts,
    )


def low_bit_matmul(
    xq: QTensor,
    wq: QTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    backend: Kernels | Backend | str | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """y [T, N] from a quantized activation xq [T, K] and weight wq [N, K] (same format)."""
    _check_weight(wq, 2)
    _check_activation(xq, wq)
    chosen = backend_for(backend, xq.device, "rollout_gemm")
    if chosen is Backend.REFERENCE:
        return reference_low_bit_matmul(xq, wq).to(out_dtype)
    cfg = config or default_config(xq.shape[0], wq, xq.device)
    return _launch(xq, wq, None, cfg, out_dtype, num_slots=0)


def grouped_low_bit_matmul(
    xq: QTensor,
    wq: QTensor,
    expert_offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    backend: Kernels | Backend | str | None = None,
    config: GemmConfig | None = None,
    active_experts: int | None = None,
) -> torch.Tensor:
    """`grouped_low_bit_linear` on a quantized activation xq [T, K] (rows sorted by expert)."""
    _check_weight(wq, 3)
    _check_activation(xq, wq)
    e = wq.shape[0]
    if expert_offsets.shape != (e + 1,) or expert_offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"expert_offsets must be an int32/int64 tensor of shape [E + 1] = [{e + 1}], got "
            f"{expert_offsets.dtype} {tuple(expert_offsets.shape)}"
        )
    if expert_offsets.device != xq.device:
        raise ValueError(f"expert_offsets on {expert_offsets.device}, activations on {xq.device}")
    chosen = backend_for(backend, xq.device, "rollout_gemm")
    if chosen is Backend.REFERENCE:
        return reference_low_bit_matmul(xq, wq, expert_offsets).to(out_dtype)
    cfg = config or default_config(xq.shape[0], wq, xq.device, active_experts)
    return _launch(xq, wq, expert_offsets, cfg, out_dtype, num_slots=max(1, min(e, xq.shape[0])))


def reference_low_bit_matmul(
    xq: QTensor, wq: QTensor, expert_offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 y [T, N]: the emulated GEMM (`mxrl.kernels.emulated`, the formula the trainer's
    `emulated_matmul` computes), per expert when grouped."""
    if xq.shape[0] == 0:
        return torch.zeros((0, wq.shape[-2]), dtype=torch.float32, device=xq.device)
    lp_x = dequantize(xq, global_scale=False)
    s_x = decode_global_scale(xq)  # [T, 1], [] or None
    if expert_offsets is None:
        return emulated_gemm(lp_x, dequantize(wq, global_scale=False), s_x, _s_w(wq, None))
    lp_w = dequantize(wq, global_scale=False)
    y = torch.zeros((lp_x.shape[0], wq.shape[1]), dtype=torch.float32, device=lp_x.device)
    bounds = expert_offsets.tolist()
    _check_offsets(bounds, lp_x.shape[0])
    for e in range(wq.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            s_xe = s_x[lo:hi] if s_x is not None and s_x.dim() else s_x
            y[lo:hi] = emulated_gemm(lp_x[lo:hi], lp_w[e], s_xe, _s_w(wq, e))
    return y


def error_bound(
    xq: QTensor, wq: QTensor, expert_offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 [T, N]: the stated bound on |y_triton - y_reference| (module docstring), fp32 y."""
    lp_x = dequantize(xq, global_scale=False).abs()
    lp_w = dequantize(wq, global_scale=False).abs()
    k = xq.shape[-1]
    s_x = decode_global_scale(xq)
    s_x = s_x.abs() if s_x is not None else None
    ulps = BOUND_ULPS * k * 2.0**-24
    if expert_offsets is None:
        return emulated_gemm(lp_x, lp_w, s_x, _abs(_s_w(wq, None))) * ulps
    out = torch.zeros((lp_x.shape[0], wq.shape[1]), dtype=torch.float32, device=lp_x.device)
    bounds = expert_offsets.tolist()
    for e in range(wq.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            s_xe = s_x[lo:hi] if s_x is not None and s_x.dim() else s_x
            out[lo:hi] = emulated_gemm(lp_x[lo:hi], lp_w[e], s_xe, _abs(_s_w(wq, e))) * ulps
    return out


# --- helpers ------------------------------------------------------------------------------------


def _s_w(wq: QTensor, e: int | None) -> torch.Tensor | None:
    """The weight's decode scale shaped to multiply [rows, N]: [] stays, [N, 1] -> [1, N]."""
    s = decode_global_scale(wq)
    if s is None or s.dim() == 0:
        return s
    if e is not None:
        s = s[e]
    return s.reshape(1, -1)


def _abs(s: torch.Tensor | None) -> torch.Tensor | None:
    return None if s is None else s.abs()


def _check_offsets(bounds: list[int], t: int) -> None:
    if bounds[0] != 0 or bounds[-1] != t or any(a > b for a, b in itertools.pairwise(bounds)):
        raise ValueError(
            f"expert_offsets must rise from 0 to T={t} (expert e owns rows offsets[e]:"
            f"offsets[e+1]), got {bounds[:4]}...{bounds[-2:]}"
        )


def _check_qtensor(t: object, what: str) -> None:
    if not isinstance(t, QTensor):
        raise TypeError(f"the {what} must be a QTensor, got {type(t).__name__}")


def _check_weight(wq: QTensor, dims: int) -> None:
    _check_qtensor(wq, "weight")
    if wq.fmt not in GEMM_FORMATS:
        raise ValueError(
            f"low-bit GEMMs take nvfp4 or mxfp8 weights, got {wq.fmt} (fp8_block weights: "
            "mxrl.kernels.fp8_gemm.fp8_block_matmul)"
        )
    if len(wq.shape) != dims or wq.axis != -1:
        what = "[N, K]" if dims == 2 else "[E, N, K] (grouped experts)"
        raise ValueError(
            f"the weight must be a {what} QTensor with blocks along K, got shape "
            f"{tuple(wq.shape)} axis={wq.axis}"
        )


def _check_activation(xq: QTensor, wq: QTensor) -> None:
    _check_qtensor(xq, "activation")
    if xq.fmt != wq.fmt or len(xq.shape) != 2 or xq.axis != -1:
        raise ValueError(
            f"the activation must be a [T, K] {wq.fmt} QTensor blocked along K, got {xq.fmt} "
            f"{tuple(xq.shape)} axis={xq.axis}"
        )
    if xq.shape[1] != wq.shape[-1]:
        raise ValueError(f"K differs: activation {tuple(xq.shape)}, weight {tuple(wq.shape)}")
    if xq.device != wq.device:
        raise ValueError(f"activation on {xq.device}, weight on {wq.device}")


def _quantize_activation(
    x: torch.Tensor, wq: QTensor, per_token: bool, backend: Backend
) -> QTensor:
    if wq.fmt is Format.NVFP4:
        if not per_token and len(wq.shape) == 3:
            raise ValueError(
                "grouped NVFP4 experts take per-token activation scales (a per-tensor scale "
                "would span all experts' rows); use act_per_token=True"
            )
        return kernel_quantize(x, Format.NVFP4, per_token=per_token, backend=backend)
    return kernel_quantize(x, Format.MXFP8, backend=backend)


def _launch(
    xq: QTensor,
    wq: QTensor,
    offsets: torch.Tensor | None,
    cfg: GemmConfig,
    out_dtype: torch.dtype,
    *,
    num_slots: int,
) -> torch.Tensor:
    from mxrl.kernels import triton_gemm  # imports triton: only on the triton backend

    fmt = triton_gemm.FMT_CODES[wq.fmt.value]
    n_tiles = -(-wq.shape[-2] // cfg.block_n)
    slots = num_slots or -(-xq.shape[0] // cfg.block_m)
    counters = triton_gemm.split_k_counters(xq.device, slots * n_tiles)
    return triton_gemm.low_bit_gemm(
        xq.qdata,
        xq.scale.view(torch.uint8),
        xq.global_scale,
        wq.qdata,
        wq.scale.view(torch.uint8),
        wq.global_scale,
        offsets,
        counters,
        fmt,
        out_dtype,
        cfg.block_m,
        cfg.block_n,
        cfg.block_k,
        cfg.split_k,
        num_slots,
        cfg.num_warps,
        cfg.num_stages,
        cfg.dot == "ieee",
        xq.device.type == "cuda",
        cfg.nvfp4_decode == "asm",
        cfg.dot == "fma",
    )
