"""Trainer-side log-probabilities of sampled tokens (what the mismatch metrics compare)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from mxrl.models import CausalLM


def completion_logprobs(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float = 1.0,
    replay_routing: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """log p(token_t | prefix) under `model` for each completion token (fp32 [len]), one
    sequence at a time (no padding in any reduction). temperature scales logits as the sampler
    did (0 means unscaled); `replay_routing[i]` ([num_moe, len-1, k], from the engine) forces
    the rollout's experts."""
    _check_positions(model, prompts, completions)
    if replay_routing is None:
        batched = sequence_logprobs(model, prompts, completions, temperature)
        return [batched[i, : len(c)].cpu() for i, c in enumerate(completions)]
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = torch.tensor([*p, *c], dtype=torch.int64, device=_device(model))[None, :-1]
        kwargs = {}
        if replay_routing is not None and replay_routing[i] is not None:
            kwargs["replay_routing"] = [r[None].to(seq.device) for r in replay_routing[i]]
        logits = model(seq, **kwargs)[0, len(p) - 1 :].float()
        if temperature not in (0.0, 1.0):
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(list(c), dtype=torch.int64, device=logp.device)
        out.append(logp.gather(-1, target[:, None])[:, 0].cpu())
    return out


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
) -> torch.Tensor:
    """log p(completion token | prefix) for a batch, [B, T_max] (0 past each completion), in one
    right-padded forward pass (the trainer needs no batch invariance)."""
    _check_positions(model, prompts, completions)
    device = next(model.parameters()).device
    seqs = [
        torch.tensor([*p, *c], dtype=torch.int64) for p, c in zip(prompts, completions, strict=True)
    ]
    lengths = torch.tensor([len(s) for s in seqs])
    ids = pad_sequence(seqs, batch_first=True).to(device)
    attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).to(device)
    logits = model(ids[:, :-1], attention_mask=attn[:, :-1].long()).float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    t_max = max((len(c) for c in completions), default=0)
    out = logp_all.new_zeros((len(seqs), t_max))
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        out[i, : len(c)] = logp_all[i, len(p) - 1 : len(p) - 1 + len(c)]
    return out
