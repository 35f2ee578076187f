"""The whole batch sampled in one launch (`sample_rows`), for rows without top-k / top-p: the
exponential race over the temperature-scaled distribution with the engine's counter-based noise
(kernel: mxrl/kernels/triton_sampling.py). Its reference is the engine's batched sampler
(`mxrl.engine.sampler`, torch ops): the noise bits are the same integers; the kernel's exp and
log are the GPU's own (the reference's are torch's), so a token can differ from the
reference's only where two candidates' scores tie within those functions' rounding, and the
logprob of the token within float rounding (tests/kernels/test_sampling.py).

A row's result comes from that row alone, and how the row is cut into parts from the
vocabulary size alone: batch invariant. Three small launches (per part: max and sum; the race;
per row: the best part) replace ~20 over the whole [R, V] logits (int64 noise arithmetic, exp,
division, argmax, gathers), and the parts of a row run side by side (one program per row took
39 us at any batch size on the H200).
"""

from __future__ import annotations

import torch

_BLOCK = 2048  # logits per program (a part of a row)


def sample_rows(
    logits_RV: torch.Tensor,
    temperature_R: torch.Tensor,
    greedy_R: torch.Tensor,
    seeds_R: torch.Tensor,
    counters_R: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [R], processed logprobs float32 [R]) on the logits' device.

    temperature fp32 [R] (1 for greedy rows), greedy bool [R], seeds / counters int64 [R]."""
    from mxrl.kernels import triton_sampling as ts

    r, v = logits_RV.shape
    for name, t in (("temperature", temperature_R), ("greedy", greedy_R), ("seeds", seeds_R)):
        if t.shape != (r,):
            raise ValueError(f"sample_rows: {name} must be [{r}], got {tuple(t.shape)}")
    logits = logits_RV if logits_RV.stride(-1) == 1 else logits_RV.contiguous()
    dev = logits.device
    tokens = torch.empty(r, dtype=torch.int64, device=dev)
    logps = torch.empty(r, dtype=torch.float32, device=dev)
    if not r:
        return tokens, logps
    block = min(_BLOCK, max(16, 1 << (v - 1).bit_length()))  # fixed by V alone
    parts = -(-v // block)
    parts_pow2 = 1 << (parts - 1).bit_length()
    temp = temperature_R.float().contiguous()
    part_max = torch.empty((r, parts), dtype=torch.float32, device=dev)
    part_sum = torch.empty_like(part_max)
    score = torch.empty_like(part_max)
    best = torch.empty((r, parts), dtype=torch.int32, device=dev)
    lse = torch.empty(r, dtype=torch.float32, device=dev)
    ts.sample_partials_kernel[(r, parts)](
        logits, temp, part_max, part_sum, logits.stride(0), v, parts, BLOCK=block, num_warps=4
    )
    ts.sample_race_kernel[(r, parts)](
        logits, temp, greedy_R.to(torch.int8).contiguous(), seeds_R.to(torch.int64).contiguous(),
        counters_R.to(torch.int64).contiguous(), part_max, part_sum, lse, score, best,
        logits.stride(0), v, parts, BLOCK=block, S_POW2=parts_pow2, num_warps=4,
    )  # fmt: skip
    ts.sample_pick_kernel[(r,)](
        logits, temp, lse, score, best, tokens, logps, logits.stride(0), parts,
        S_POW2=parts_pow2, num_warps=1,
    )  # fmt: skip
    return tokens, logps
