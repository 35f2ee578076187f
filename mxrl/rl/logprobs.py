"""Trainer-side log-probabilities of sampled tokens (what the mismatch metrics compare)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

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


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
