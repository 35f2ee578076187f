"""The whole batch sampled in one launch (`sample_rows`), for rows without top-k / top-p: the
exponential race over the temperature-scaled distribution with the engine's counter-based noise
(kernel: mxrl/kernels/triton_sampling.py). Its reference is the engine's batched sampler
(`mxrl.engine.sampler`, torch ops): the noise bits are the same integers; the kernel's exp and
log are the GPU's own (the reference's are torch's), so a token can differ from the
reference's only where two candidates' scores tie within those functions' rounding, and the
logprob of the token within float rounding (tests/kernels/test_sampling.py).

One program per row and a row's result from that row alone: batch invariant. It replaces ~20
launches over the whole [R, V] logits (int64 noise arithmetic, exp, division, argmax, gathers)
by one pass that reads the logits three times and writes two numbers per row.
"""

from __future__ import annotations

import torch

_BLOCK = 1024


def sample_rows(
    logits_RV: torch.Tensor,
    temperature_R: torch.Tensor,
    greedy_R: torch.Tensor,
    seeds_R: torch.Tensor,
    counters_R: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [R], processed logprobs float32 [R]) on the logits' device.

    temperature fp32 [R] (1 for greedy rows), greedy bool [R], seeds / counters int64 [R]."""
    from mxrl.kernels.triton_sampling import sample_rows_kernel

    r, v = logits_RV.shape
    for name, t in (("temperature", temperature_R), ("greedy", greedy_R), ("seeds", seeds_R)):
        if t.shape != (r,):
            raise ValueError(f"sample_rows: {name} must be [{r}], got {tuple(t.shape)}")
    logits = logits_RV if logits_RV.stride(-1) == 1 else logits_RV.contiguous()
    tokens = torch.empty(r, dtype=torch.int64, device=logits.device)
    logps = torch.empty(r, dtype=torch.float32, device=logits.device)
    if r:
        sample_rows_kernel[(r,)](
            logits, temperature_R.float().contiguous(), greedy_R.to(torch.int8).contiguous(),
            seeds_R.to(torch.int64).contiguous(), counters_R.to(torch.int64).contiguous(),
            tokens, logps, logits.stride(0), v, BLOCK=min(_BLOCK, max(16, 1 << (v - 1).bit_length())),
            num_warps=4,
        )  # fmt: skip
    return tokens, logps
