"""Trainer-side log-probabilities of sampled tokens (what the mismatch metrics compare).

They are taken under the distribution the engine sampled from: logits / temperature, then the
same top-k and top-p filters (`mxrl.engine.sampler.filter_logits`, one implementation for both),
renormalised. Without the filters, a rollout at top_p 0.9 would be compared with the full
distribution and the mismatch metrics and TIS would count sampling truncation as precision
mismatch. A sampled token is never filtered out here: where precision moved a filter's boundary,
it keeps a finite logprob and the difference shows in the metrics.

Only the completion tokens' logits are made, `logits_chunk_tokens` tokens at a time (the
lm_head, the fp32 log-softmax and the gather of one chunk, then the next): the pass never holds
the batch's [tokens, vocabulary] logits. Under autograd each chunk is recomputed in the
backward (`torch.utils.checkpoint`), so the backward holds one chunk's logits too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint

from mxrl.engine.params import SamplingParams
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
    params: SamplingParams | None = None,
    *,
    replay_routing: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """log p(token_t | prefix) under `model` for each completion token (fp32 [len]), one
    sequence at a time (no padding in any reduction). params: the SamplingParams the engine
    sampled with (its temperature, top_k and top_p; temperature 0, greedy, means unscaled; None:
    the plain distribution); `replay_routing[i]` ([num_moe, len-1, k], from the engine) forces
    the rollout's experts."""
    _check_positions(model, prompts, completions)
    params = SamplingParams() if params is None else params
    temperature, top_k, top_p = params.temperature, params.top_k, params.top_p
    if replay_routing is None:
        batched = sequence_logprobs(model, prompts, completions, temperature, top_k, top_p)
        return [batched[i, : len(c)].cpu() for i, c in enumerate(completions)]
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = torch.tensor([*p, *c], dtype=torch.int64, device=_device(model))[None, :-1]
        kwargs = {}
        if replay_routing[i] is not None:
            kwargs["replay_routing"] = [r[None].to(seq.device) for r in replay_routing[i]]
        hidden = model(seq, return_hidden=True, **kwargs)[0, len(p) - 1 :]
        target = torch.tensor(list(c), dtype=torch.int64, device=hidden.device)
        out.append(token_logprobs(model, hidden, target, temperature, top_k, top_p).cpu())
    return out


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
    top_p as the sampler applied them. Differentiable: the trainer's loss takes its gradient."""
    _check_positions(model, prompts, completions)
    device = _device(model)
    seqs = [
        torch.tensor([*p, *c], dtype=torch.int64) for p, c in zip(prompts, completions, strict=True)
    ]
    lengths = torch.tensor([len(s) for s in seqs])
    ids = pad_sequence(seqs, batch_first=True)
    attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    hidden = model(
        ids[:, :-1].to(device), attention_mask=attn[:, :-1].to(device), return_hidden=True
    )
    # the completion tokens' positions: row i predicts c[t] at column len(p_i) - 1 + t
    rows = torch.cat([torch.full((len(c),), i) for i, c in enumerate(completions)] or [_NONE])
    steps = torch.cat([torch.arange(len(c)) for c in completions] or [_NONE])
    starts = torch.tensor([len(p) - 1 for p in prompts])
    cols = starts[rows] + steps
    target = ids[rows, cols + 1].to(device)
    logp = token_logprobs(
        model, hidden[rows.to(device), cols.to(device)], target, temperature, top_k, top_p
    )
    t_max = max((len(c) for c in completions), default=0)
    out = logp.new_zeros((len(seqs), t_max))
    return out.index_put((rows.to(device), steps.to(device)), logp)


_NONE = torch.zeros(0, dtype=torch.int64)


def token_logprobs(
    model: CausalLM,
    hidden_NH: torch.Tensor,
    target_N: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """fp32 [N]: log p(target_N[n]) under the sampled-from distribution of `model.logits` on
    hidden state n, `logits_chunk_tokens` tokens at a time (module docstring). Under autograd
    with more than one chunk, each chunk's logits are recomputed in the backward."""
    chunk = logits_chunk_tokens(model.config.vocab_size)
    if hidden_NH.shape[0] <= chunk:
        return _chunk_logprobs(model, hidden_NH, target_N, temperature, top_k, top_p)
    recompute = torch.is_grad_enabled() and hidden_NH.requires_grad
    parts = []
    for lo in range(0, hidden_NH.shape[0], chunk):
        h, t = hidden_NH[lo : lo + chunk], target_N[lo : lo + chunk]
        if recompute:
            part = checkpoint(
                _chunk_logprobs, model, h, t, temperature, top_k, top_p, use_reentrant=False
            )
        else:
            part = _chunk_logprobs(model, h, t, temperature, top_k, top_p)
        parts.append(part)
    return torch.cat(parts)


def _chunk_logprobs(
    model: CausalLM,
    hidden_NH: torch.Tensor,
    target_N: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
) -> torch.Tensor:
    logp = _processed_logprobs(model.logits(hidden_NH), target_N, temperature, top_k, top_p)
    return logp.gather(-1, target_N[:, None])[:, 0]


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
