"""Sampling the whole batch in one pass, with the processed logprob of the token sampled.

Legend: R rows (requests sampling this step), V vocab.

Randomness is counter-based: a request's noise for its n-th generated token is a hash of
(its seed, n, the vocabulary index) — no generator state, so a request's samples depend on
nothing but its seed and its own tokens, whatever batch it runs in, and preemption or
recomputation never shifts them. The draw is the exponential race
`argmax_v p(v) / E(v)`, E ~ Exp(1) (as vLLM samples): one uniform per vocabulary entry from the
hash, `E = -log u`.

On CUDA the batch is processed as one `[R, V]` tensor (element-wise ops are per element, the
reductions — log-softmax, cumsum, argmax — per row), with one host transfer for the step. On
the CPU, ATen's vectorised element-wise kernels round their vector body and scalar tail
differently (mxrl.nn.invariant), so a row is processed alone, as a `[1, V]` tensor: its bytes
then do not depend on the batch either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mxrl.engine.params import SamplingParams

_M32 = 0xFFFFFFFF
# Mixing constants below 2^31: every product of a 32-bit value stays below 2^63 (exact int64,
# the same on every device).
_MIX1, _MIX2 = 0x7FEB352D, 0x2C1B3C6D
_GOLDEN = 0x1E3779B9
_VOCAB_KEY = 0x5BD1E995 & 0x7FFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 values in [0, 2^32) (xor-shift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _M32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds_R: torch.Tensor, counters_R: torch.Tensor, vocab: int) -> torch.Tensor:
    """u in (0, 1), float32 [R, V]: a hash of (seed, counter, vocabulary index), exact integer
    arithmetic (the same bits on every device and in every batch); 23 random bits per entry."""
    seeds = seeds_R.to(torch.int64)
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    row = _mix32(lo ^ _mix32(hi ^ _mix32((counters_R.to(torch.int64) * _GOLDEN + 1) & _M32)))
    v = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = _mix32(row[:, None] ^ ((v * _VOCAB_KEY) & _M32)[None, :])
    x = _mix32(x ^ row[:, None])
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # exact: 24 bits


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors on the logits' device.

    temperature: float32 [R] (1 for greedy rows: they use the unscaled distribution);
    top_k: int64 [R] (0 off); top_p: float32 [R]; greedy: bool [R]; seeds, counters:
    int64 [R] (the counter is the number of tokens the request generated so far).
    `uniform` is set when every row shares the same parameters (the usual RL case): the filters
    then run only when that row's setting asks for them.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    seeds: torch.Tensor
    counters: torch.Tensor
    any_top_k: bool
    any_top_p: bool
    any_greedy: bool
    all_greedy: bool

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        counters: Sequence[int],
        device: torch.device,
    ) -> SamplingBatch:
        ints = torch.tensor(
            [[p.top_k for p in params], list(seeds), list(counters)], dtype=torch.int64
        )
        floats = torch.tensor(
            [[1.0 if p.greedy else p.temperature for p in params], [p.top_p for p in params]],
            dtype=torch.float32,
        )
        greedy = [p.greedy for p in params]

        def upload(t: torch.Tensor) -> torch.Tensor:
            # pinned: the copy is queued behind the step on the stream instead of making the
            # host wait for the step first (a copy from pageable memory synchronises the
            # stream), so the sampler is launched while the step still runs on the device
            pinned = t.pin_memory() if torch.device(device).type == "cuda" else t
            return pinned.to(device, non_blocking=True)

        ints, floats = upload(ints), upload(floats)
        return cls(
            temperature=floats[0],
            top_p=floats[1],
            top_k=ints[0],
            seeds=ints[1],
            counters=ints[2],
            greedy=upload(torch.tensor(greedy, dtype=torch.bool)),
            any_top_k=any(p.top_k for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_greedy=any(greedy),
            all_greedy=all(greedy),
        )

    def rows(self, start: int, stop: int) -> SamplingBatch:
        return SamplingBatch(
            self.temperature[start:stop],
            self.top_k[start:stop],
            self.top_p[start:stop],
            self.greedy[start:stop],
            self.seeds[start:stop],
            self.counters[start:stop],
            self.any_top_k,
            self.any_top_p,
            self.any_greedy,
            self.all_greedy,
        )


def processed_logprobs_batch(logits_RV: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """log-probabilities [R, V] of the distributions sampled from: logits / temperature, then
    top-k, then top-p (`filter_logits`), renormalised. Filtered tokens get -inf. Greedy rows use
    the unscaled distribution."""
    logits = logits_RV.float() / b.temperature[:, None]
    top_k = b.top_k if b.any_top_k else None
    top_p = b.top_p if b.any_top_p else None
    return torch.log_softmax(filter_logits(logits, top_k, top_p), dim=-1)


def filter_logits(
    logits_NV: torch.Tensor,
    top_k_N: torch.Tensor | None = None,
    top_p_N: torch.Tensor | None = None,
    *,
    keep_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """Temperature-scaled logits [N, V] with the tokens top-k and then top-p drop set to -inf:
    top-k keeps every token reaching the k-th largest logit (ties at the boundary kept; k = 0 or
    >= V: off), top-p the nucleus over the sorted probabilities, the token crossing p kept
    (p = 1: off). Ties in the sort are broken by vocabulary index (stable), so the filters are
    deterministic. The engine's sampler and the
    trainer's logprobs (`mxrl.rl.logprobs`) both call this, so both see one distribution.

    keep_N: int64 [N] token ids never dropped (the trainer's sampled tokens: where precision
    moved a filter's boundary between engine and trainer, the sampled token keeps a finite
    logprob and the mismatch metrics count the difference)."""
    logits = logits_NV
    vocab = logits.shape[-1]
    if top_k_N is not None:
        k = top_k_N.clamp(0, vocab)
        sorted_logits = torch.sort(logits, dim=-1, descending=True, stable=True).values
        kth = sorted_logits.gather(-1, (k - 1).clamp(min=0)[:, None])
        drop = (logits < kth) & ((k > 0) & (k < vocab))[:, None]
        logits = logits.masked_fill(_keeping(drop, keep_N), float("-inf"))
    if top_p_N is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = (before >= top_p_N[:, None]) & (top_p_N < 1.0)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(_keeping(drop, keep_N), float("-inf"))
    return logits


def _keeping(drop_NV: torch.Tensor, keep_N: torch.Tensor | None) -> torch.Tensor:
    if keep_N is None:
        return drop_NV
    return drop_NV.scatter(-1, keep_N[:, None], False)


def _sample_rows(logits_RV: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [R], their processed logprobs float32 [R]) on the logits' device."""
    logp = processed_logprobs_batch(logits_RV, b)
    if b.all_greedy:
        tokens = torch.argmax(logp, dim=-1)
    else:
        noise = -torch.log(uniform_noise(b.seeds, b.counters, logp.shape[-1]))  # Exp(1)
        tokens = torch.argmax(logp.exp() / noise, dim=-1)
        if b.any_greedy:
            tokens = torch.where(b.greedy, torch.argmax(logp, dim=-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def sample_batch(
    logits_RV: torch.Tensor, b: SamplingBatch, *, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [R], processed logprobs float32 [R]), still on the logits' device: one
    batched pass on CUDA, row by row on the CPU (module docstring). fused: rows without top-k
    / top-p go through the one-launch Triton sampler (`mxrl.kernels.sampling`; the engine's
    triton backend on CUDA)."""
    if logits_RV.shape[0] == 0:  # a step where no sequence samples (chunked prefill)
        empty = torch.zeros(0, dtype=torch.float32, device=logits_RV.device)
        return empty.long(), empty
    if fused:
        # a row's path is fixed by its own parameters, never by its batch: rows without top-k /
        # top-p always take the fused kernel, filtered rows always the torch pass (the two
        # logprobs may differ in the last bit, so choosing per batch would break invariance)
        from mxrl.kernels.sampling import sample_rows

        tokens, logps = sample_rows(logits_RV, b.temperature, b.greedy, b.seeds, b.counters)
        if not (b.any_top_k or b.any_top_p):
            return tokens, logps
        vocab = logits_RV.shape[-1]
        filtered = ((b.top_k > 0) & (b.top_k < vocab)) | (b.top_p < 1.0)
        t_torch, lp_torch = _sample_rows(logits_RV, b)
        return torch.where(filtered, t_torch, tokens), torch.where(filtered, lp_torch, logps)
    if logits_RV.device.type != "cpu":
        return _sample_rows(logits_RV, b)
    parts = [_sample_rows(logits_RV[r : r + 1], b.rows(r, r + 1)) for r in range(len(logits_RV))]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def processed_logprobs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`processed_logprobs_batch` of one row [V] under `params` (for checks and tests)."""
    b = SamplingBatch.build([params], [0], [0], logits_V.device)
    return processed_logprobs_batch(logits_V[None], b)[0]
