"""YaRN RoPE scaling as transformers 5 computes it (`_compute_yarn_parameters` of
`modeling_rope_utils.py`, checked: 5.24), for the families that allow it (DeepSeek-V3's
`rope_scaling: {type: yarn, ...}`): the inverse frequencies blend interpolated (/ factor) and
extrapolated frequencies along a linear ramp between the correction dims of beta_fast and
beta_slow; cos and sin are multiplied by the attention factor; DeepSeek's attention multiplies
its softmax scale by mscale(factor, mscale_all_dim)^2 (`softmax_mscale`).

`params` are `ModelConfig.rope_scaling` as a dict: factor, original_max_position_embeddings
(both always set by `ModelConfig.from_hf`), optional beta_fast, beta_slow, mscale,
mscale_all_dim, attention_factor, truncate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(params: Mapping[str, Any]) -> float:
    """What cos and sin are multiplied by."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, m, m_all = params["factor"], params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return float(_mscale(factor, m) / _mscale(factor, m_all))
    return _mscale(factor)


def softmax_mscale(params: Mapping[str, Any]) -> float:
    """transformers' `yarn_apply_mscale` factor of DeepSeek-V3's softmax scale."""
    m_all = params.get("mscale_all_dim", 0)
    if not m_all:
        return 1.0
    m = _mscale(params["factor"], m_all)
    return m * m


def inv_freq(dim: int, base: float, params: Mapping[str, Any]) -> torch.Tensor:
    """The yarn inverse frequencies [dim // 2] in fp32, op for op as transformers."""
    factor = params["factor"]
    original = params["original_max_position_embeddings"]
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    truncate = params.get("truncate", True)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
