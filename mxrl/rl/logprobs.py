"""Trainer-side log-probabilities of sampled tokens (what the mismatch metrics compare).

They are taken under the distribution the engine sampled from: logits / temperature, then the
same top-k and top-p filters (`mxrl.engine.sampler.filter_logits`, one implementation for both),
renormalised. Without the filters, a rollout at top_p 0.9 would be compared with the full
distribution and the mismatch metrics and TIS would count sampling truncation as precision
mismatch. A sampled token is never filtered out here: where precision moved a filter's boundary,
it keeps a finite logprob and the difference shows in the metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from mxrl.engine.sampler import filter_logits
from mxrl.models import CausalLM

# The lm_head's logits are made (and log-softmaxed) for this many bytes of fp32 logits at a
# time: the passes never hold a [tokens, vocabulary] tensor of the whole batch (8 GB for 256
# sequences of 256 tokens at a 32k vocabulary; terabytes at the field's 8k-token, 152k-vocabulary
# batches). Each chunk holds about three such tensors at its peak (logits, log-softmax, grad).
LOGITS_CHUNK_BYTES = 1 << 28


def logits_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the logprob computation: LOGITS_CHUNK_BYTES of fp32 logits."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


def completion_logprobs(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    replay_routing: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """log p(token_t | prefix) under `model` for each completion token (fp32 [len]), one
    sequence at a time (no padding in any reduction). temperature, top_k and top_p as the
    sampler applied them (temperature 0 means unscaled); `replay_routing[i]` ([num_moe, len-1,
    k], from the engine) forces the rollout's experts."""
    _check_positions(model, prompts, completions)
    if replay_routing is None:
        batched = sequence_logprobs(model, prompts, completions, temperature, top_k, top_p)
        return [batched[i, : len(c)].cpu() for i, c in enumerate(completions)]
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = torch.tensor([*p, *c], dtype=torch.int64, device=_device(model))[None, :-1]
        kwargs = {}
        if replay_routing is not None and replay_routing[i] is not None:
            kwargs["replay_routing"] = [r[None].to(seq.device) for r in replay_routing[i]]
        logits = model(seq, **kwargs)[0, len(p) - 1 :]
        target = torch.tensor(list(c), dtype=torch.int64, device=logits.device)
        logp = _processed_logprobs(logits, target, temperature, top_k, top_p)
        out.append(logp.gather(-1, target[:, None])[:, 0].cpu())
    return out


def _processed_logprobs(
    logits_NV: torch.Tensor, target_N: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """log-softmax [N, V] of the sampled-from distribution (module docstring), fp32."""
    logits = logits_NV.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    if top_k or top_p < 1.0:
        n = logits.shape[0]
        k = torch.full((n,), top_k, dtype=torch.int64, device=logits.device) if top_k else None
        p = torch.full((n,), top_p, dtype=torch.float32, device=logits.device)
        logits = filter_logits(logits, k, p if top_p < 1.0 else None, keep_N=target_N)
    return torch.log_softmax(logits, dim=-1)


def _check_positions(model: CausalLM, prompts, completions) -> None:
    """Each prompt + completion within the model's max_position_embeddings (lengths only: no
    read from the device). The engine refuses such requests already; this is for completions
    from elsewhere."""
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        model.config.check_positions(len(p), len(c), f"sequence {i}", "its completion's length")


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def sequence_logprobs(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """log p(completion token | prefix) for a batch, [B, T_max] (0 past each completion), in one
    right-padded forward pass (the trainer needs no batch invariance); temperature, top_k and
    top_p as the sampler applied them."""
    _check_positions(model, prompts, completions)
    device = next(model.parameters()).device
    seqs = [
        torch.tensor([*p, *c], dtype=torch.int64) for p, c in zip(prompts, completions, strict=True)
    ]
    lengths = torch.tensor([len(s) for s in seqs])
    ids = pad_sequence(seqs, batch_first=True).to(device)
    attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).to(device)
    logits = model(ids[:, :-1], attention_mask=attn[:, :-1].long())
    b, t, v = logits.shape
    target = ids[:, 1:].reshape(-1)
    logp = _processed_logprobs(logits.reshape(b * t, v), target, temperature, top_k, top_p)
    logp_all = logp.gather(-1, target[:, None])[:, 0].view(b, t)
    t_max = max((len(c) for c in completions), default=0)
    out = logp_all.new_zeros((len(seqs), t_max))
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        out[i, : len(c)] = logp_all[i, len(p) - 1 : len(p) - 1 + len(c)]
    return out
