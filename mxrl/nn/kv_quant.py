"""The FP8 KV cache's numbers (recipe `kv_cache: fp8`, docs/recipes.md "The KV cache").

Keys (after RoPE) and values are held as E4M3 codes with one fp32 scale per token and KV head:
block FP8 (`mxrl.formats.fp8_block`, spec §5) in one 1 x D block over the head dim,

    sf = fl(max(amax, 1e-4) / 448);  q = E4M3(fl(x * fl(1 / sf)));  x_hat = fl(fl32(q) * sf)

then cast to the attention's dtype. A vector's codes and scale depend on that vector alone: no
calibration, no state carried from step to step, nothing that depends on the batch (batch
invariance holds as for the bf16 cache). The rollout engine stores (q, sf) and reads x_hat
(`mxrl.engine.kv_cache`); the trainer's attention sees the same x_hat (`fake_quant_kv`), so the
trainer's logprobs are computed on the keys and values the rollout attended to. The backward is
straight-through (the gradient of x_hat is taken as the gradient of x).

Legend: D head dim; `...` any leading dims (tokens, heads).
"""

from __future__ import annotations

import torch

from mxrl.formats import codecs
from mxrl.formats.constants import Format
from mxrl.kernels import Backend, Kernels, quantize
from mxrl.kernels.api import KERNEL_FP8_BLOCK_SIZES

KV_CODE_DTYPE = torch.uint8  # E4M3 bytes
KV_SCALE_DTYPE = torch.float32


def quantize_kv(
    x: torch.Tensor, backend: Kernels | Backend | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [..., D], scales fp32 [...]) of `x` [..., D], one scale per D-vector, by the
    one block-FP8 quantizer (`mxrl.kernels.quantize`: the same bytes on every backend)."""
    d = x.shape[-1]
    if d not in KERNEL_FP8_BLOCK_SIZES:  # a head dim the Triton quantizer has no block for
        backend = Backend.REFERENCE
    q = quantize(x.reshape(-1, d), Format.FP8_BLOCK, block=(1, d), backend=backend)
    return q.qdata.view(x.shape), q.scale.view(x.shape[:-1])


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x_hat in `dtype`: fl(fp32(E4M3 code) * scale), then the cast (module docstring)."""
    return (codecs.e4m3_decode(codes) * scales.unsqueeze(-1)).to(dtype)


class _FakeQuantKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        codes, scales = quantize_kv(x.detach())
        return dequantize_kv(codes, scales, x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad  # straight-through


def fake_quant_kv(x: torch.Tensor) -> torch.Tensor:
    """What the FP8 KV cache gives back for `x` [..., D], in x's dtype: the trainer's keys and
    values under `kv_cache: fp8` (straight-through backward)."""
    return _FakeQuantKV.apply(x)
