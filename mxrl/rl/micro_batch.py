"""The training pass in micro-batches by a token budget (verl's `use_dynamic_bsz` with
`ppo_max_token_len_per_gpu`, slime's `--max-tokens-per-gpu`).

A train rank's sequences are cut, longest first, into runs whose padded forward (sequences x
the longest one's tokens) stays within `max_tokens`; each micro-batch runs forward, loss and
backward, gradients accumulating until the step's one optimizer update. Longest first, because
an RL batch's responses run from a few tokens to thousands: cut in request order, each
micro-batch pads its short sequences to a long one's length (the seeded spread of
`benchmarks/rl_step.py`, 256 sequences of 527 to 4,095 forward tokens in a 13,056-token budget,
ran 1.62x the real tokens in 64 forwards), while sequences of like lengths together pad little
(1.02x in 38). The first micro-batch holds the longest sequences, so a budget too large for the
memory fails at once. The loss of every micro-batch is divided by the whole batch's token count
(`policy_loss(denominator=...)`), so the summed gradient is the whole batch's token-mean: one
micro-batch or many differ only in the order of fp32 sums (tests/rl/test_micro_batch.py states
the bound).

Under FSDP2 every train rank must run the same number of forwards (each one all-gathers every
layer with the others): the count is the largest any rank needs, a rank that needs fewer splits
its micro-batches further, and one with fewer sequences than that count runs its shortest
sequence again (the first of the shortest) with its loss multiplied by zero (`MicroBatch.weight`
0): the cheapest forward it can add.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mxrl.rl.actor import TrainRanks

# stats of `policy_loss` that add over micro-batches and ranks once their loss shares one
# denominator, and those that take the largest; every other one is a mean over tokens
SUMMED = ("loss/pg", "loss/kl", "loss/total", "loss/num_tokens")
MAXIMA = ("ratio/max", "tis/rho_max")


@dataclass(frozen=True)
class MicroBatch:
    """Positions (into the rank's sequences) of one forward; weight 0: a pass run only so that
    every rank runs as many forwards as the others (its loss counts nothing)."""

    rows: tuple[int, ...]
    weight: float = 1.0


def padded_tokens(lengths: Sequence[int], rows: Sequence[int]) -> int:
    """Tokens of one right-padded forward over `rows`: their count x the longest."""
    return len(rows) * max((lengths[r] for r in rows), default=0)


def split(lengths: Sequence[int], max_tokens: int | None) -> list[tuple[int, ...]]:
    """Runs of rows whose padded forward fits `max_tokens` (None: one run, request order): the
    rows taken longest first (equal lengths in request order), a run closed when the next row
    would take it past the budget; each run's rows in request order, the runs longest first. A
    sequence longer than the budget alone is a run of its own (the memory estimate refuses such
    a budget before the run starts)."""
    if max_tokens is None or not lengths:
        return [tuple(range(len(lengths)))] if lengths else []
    runs: list[list[int]] = [[]]
    for r in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        # the run's first row is its longest: its padded forward is its count x that length
        if runs[-1] and (len(runs[-1]) + 1) * lengths[runs[-1][0]] > max_tokens:
            runs.append([])
        runs[-1].append(r)
    return [tuple(sorted(run)) for run in runs]


def plan(lengths: Sequence[int], max_tokens: int | None, ranks: TrainRanks) -> list[MicroBatch]:
    """This rank's micro-batches: `split`, then as many as the train rank that needs the most
    (module docstring). On one process, `split` as it is."""
    runs = split(lengths, max_tokens)
    if ranks.size == 1:
        return [MicroBatch(run) for run in runs]
    count = int(ranks.max(torch.tensor([len(runs)], dtype=torch.int64))[0])
    while len(runs) < count and any(len(run) > 1 for run in runs):
        i = max(range(len(runs)), key=lambda j: (padded_tokens(lengths, runs[j]), -j))
        if len(runs[i]) == 1:  # the largest holds one sequence: split the longest run instead
            i = max(range(len(runs)), key=lambda j: len(runs[j]))
        half = len(runs[i]) // 2
        runs[i : i + 1] = [runs[i][:half], runs[i][half:]]
    batches = [MicroBatch(run) for run in runs]
    shortest = min(range(len(lengths)), key=lambda r: (lengths[r], r), default=None)
    filler = MicroBatch(() if shortest is None else (shortest,), weight=0.0)
    return batches + [filler] * (count - len(batches))


def combine(parts: Sequence[tuple[dict[str, float], float]], ranks: TrainRanks) -> dict[str, float]:
    """One set of loss stats from every micro-batch's (stats, valid tokens) on every train rank:
    the sums of SUMMED, the maxima of MAXIMA, the token-weighted means of the rest. A single
    micro-batch on one process is returned as it is (its loss stats are the batch's)."""
    if len(parts) == 1 and ranks.size == 1:
        return dict(parts[0][0])
    keys = sorted(k for k in parts[0][0] if isinstance(parts[0][0][k], float))
    tokens = sum(t for _, t in parts)
    added, largest = [], []
    for k in keys:
        if k in MAXIMA:
            largest.append(max(stats[k] for stats, _ in parts))
        elif k in SUMMED:
            added.append(sum(stats[k] for stats, _ in parts))
        else:
            added.append(sum(stats[k] * t for stats, t in parts))
    total = ranks.sum(torch.tensor([*added, tokens], dtype=torch.float64)).tolist()
    peak = ranks.max(torch.tensor(largest, dtype=torch.float64)).tolist() if largest else []
    count = total[-1] or 1.0
    out, a, m = dict(parts[0][0]), iter(total[:-1]), iter(peak)
    for k in keys:
        if k in MAXIMA:
            out[k] = float(next(m))
        else:
            value = float(next(a))
            out[k] = value if k in SUMMED else value / count
    return out
