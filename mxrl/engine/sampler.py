"""Sampling one token per request, with the processed logprob of the token actually sampled.

Each request samples with its own torch.Generator (seeded per request), row by row, so its
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from mxrl.engine.params import SamplingParams


def processed_logprobs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log-probabilities [V] of the distribution sampled from: logits / temperature, then top-k,
    then top-p (nucleus over the sorted probabilities, the token crossing p kept), renormalised.
    Filtered tokens get -inf. Greedy (temperature 0) uses the unscaled distribution."""
    logits = logits_V.float()
    if not params.greedy and params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample(
    logits_RV: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[float]]:
    """One token and its processed logprob per request row."""
    tokens, logprobs = [], []
    for row, p, gen in zip(logits_RV, params, generators, strict=True):
        logp = processed_logprobs(row, p)
        if p.greedy:
            token = int(torch.argmax(logp))
        else:
            # exponential race: argmax(p / E), E ~ Exp(1) -- a draw from p (as vLLM samples)
            noise = torch.empty(logp.shape, dtype=torch.float32).exponential_(generator=gen)
            token = int(torch.argmax(logp.exp().cpu() / noise))
        tokens.append(token)
        logprobs.append(float(logp[token]))
    return tokens, logprobs
