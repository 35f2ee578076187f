"""Numerics shared by tests, weight export (per-layer SQNR) and reports."""

from __future__ import annotations

import hashlib
import math

import torch


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10*log10(sum ref^2 / sum (ref - approx)^2), in dB
    (float64 sums). +inf when the two are equal."""
    ref = reference.detach().to(torch.float64)
    err = ref - approx.detach().to(torch.float64)
    noise = float((err * err).sum())
    signal = float((ref * ref).sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (contiguous, on CPU), dtype-agnostic."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).cpu().numpy().tobytes()


def tensor_hash(t: torch.Tensor) -> str:
    """sha256 over dtype, shape and raw bytes: equal hashes mean bit-identical tensors."""
    h = hashlib.sha256()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(tensor_bytes(t))
    return h.hexdigest()
