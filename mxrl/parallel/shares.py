"""Data-parallel rollout: each rollout rank serves a contiguous share of the step's prompt
groups; the completions (tokens, logprobs, routing records) come back in request order.

Shares are whole GRPO groups (every sample of a prompt on one rank), contiguous and in rank
order, so concatenating the ranks' results restores the single-process request order, and a
request's sampling seed (a function of its index in the step) does not depend on where it ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist


def share(num_items: int, num_parts: int, part: int) -> range:
    """Item indices of `part` (0-based) when `num_items` are split into `num_parts` contiguous,
    near-equal shares (the first `num_items % num_parts` shares one longer)."""
    if not 0 <= part < num_parts:
        raise ValueError(f"part {part} is not in 0..{num_parts - 1}")
    base, extra = divmod(num_items, num_parts)
    start = part * base + min(part, extra)
    return range(start, start + base + (part < extra))


def gather_in_order(items: Sequence[Any], members: Sequence[int], group=None) -> list[Any]:
    """Every rank's `items` (a list; ranks outside `members` pass []), concatenated in the order
    of `members`: one all_gather_object over `group` (the whole world by default)."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, list(items), group=group)
    out: list[Any] = []
    for rank in members:
        index = dist.get_group_rank(group, rank) if group is not None else rank
        out.extend(everyone[index])
    return out


def gather_objects(obj: Any, group=None) -> list[Any]:
    """Every rank's `obj`, by rank in `group`."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone
