"""Independent transcriptions of the sampler's spec (docs/engine.md, "Sampling and logprobs"),
in NumPy float64 and plain Python integers, for the sampler tests to compare against.

- The processed distribution: logits / temperature (temperature 0: greedy, the unscaled
  logits), then top-k (every token whose logit reaches the k-th largest is kept; k = 0 or
  k >= V is off), then top-p over the renormalised probabilities sorted in descending order,
  ties by vocabulary index (a token is kept while the mass strictly before it is < p, so the
  token that crosses p is kept; p >= 1 is off), renormalised.
- The noise: u = hash(seed, counter, vocabulary index) in (0, 1), 23 random bits; the draw is
  the exponential race argmax_v p(v) / E(v), E = -log u.
"""

from __future__ import annotations

import numpy as np

M32 = 0xFFFFFFFF


def processed_probs(
    logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
    """float64 [V]: the probabilities the sampler draws from (0 for filtered tokens)."""
    x = np.asarray(logits, dtype=np.float64)
    if temperature > 0:
        x = x / temperature
    vocab = len(x)
    keep = np.ones(vocab, dtype=bool)
    if 0 < top_k < vocab:
        kth = sorted(x.tolist(), reverse=True)[top_k - 1]
        keep &= x >= kth
    if top_p < 1.0:
        p = _softmax(x, keep)
        mass = 0.0
        for v in sorted(range(vocab), key=lambda v: (-p[v], v)):
            if keep[v] and mass >= top_p:
                keep[v] = False
            mass += p[v]
    return _softmax(x, keep)


def top_p_margin(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> float:
    """How far every cumulative mass of the top-p pass lies from p (a float32 pass agrees with
    this float64 one on the kept set when the margin is far above float32 rounding)."""
    if top_p >= 1.0:
        return float("inf")
    probs = processed_probs(logits, temperature, top_k, 1.0)
    ordered = sorted(probs.tolist(), reverse=True)
    return float(min(abs(c - top_p) for c in np.cumsum([0.0, *ordered])))


def _softmax(x: np.ndarray, keep: np.ndarray) -> np.ndarray:
    z = np.where(keep, x - x[keep].max(), -np.inf)
    e = np.exp(z)
    return e / e.sum()


def _mix32(x: int) -> int:
    """The hash's rounds on Python integers (unbounded: no int64 wrap can hide here)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & M32
    return x ^ (x >> 16)


def uniform(seed: int, counter: int, v: int) -> float:
    lo, hi = seed & M32, (seed >> 32) & M32
    row = _mix32(lo ^ _mix32(hi ^ _mix32((counter * 0x1E3779B9 + 1) & M32)))
    x = _mix32(row ^ ((v * (0x5BD1E995 & 0x7FFFFFFF)) & M32))
    x = _mix32(x ^ row)
    return ((x >> 9) + 0.5) / (1 << 23)


def race(probs: np.ndarray, seed: int, counter: int) -> int:
    """The exponential race's token under this request's noise."""
    noise = -np.log([uniform(seed, counter, v) for v in range(len(probs))])
    return int(np.argmax(probs / noise))
