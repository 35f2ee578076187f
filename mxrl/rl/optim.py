"""The trainers' optimizer: AdamW on the master weights, one construction for every placement.

`fused=True` is torch's one-kernel AdamW (CPU and CUDA). Besides being the fastest
implementation, it is the one whose result does not depend on the processor: the for-loop and
foreach implementations take `sqrt(exp_avg_sq)` from `torch.sqrt`, which ATen hands to MKL's
vector math library on x86 CPUs, and MKL's single-precision sqrt is not correctly rounded and
rounds differently on AVX-512 Intel processors than on AMD ones (measured: 172 of 4096 elements
of one update differed by one ulp, with `MKL_CBWR=COMPATIBLE` and every `MKL_ENABLE_INSTRUCTIONS`
setting; tests/golden/README.md). The fused kernel computes its square roots with the IEEE
instruction, correctly rounded everywhere. Adam is elementwise, so an FSDP2 shard's update is
the same bytes as the unsharded one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def adamw(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
) -> torch.optim.AdamW:
    """AdamW (decoupled weight decay, eps 1e-8), the fused implementation."""
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
