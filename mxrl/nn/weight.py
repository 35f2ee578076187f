"""One quantized weight and its cache (docs/nn.md "The quantized weight")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

if TYPE_CHECKING:
    from mxrl.nn.qmatmul import QuantizedWeight

_WEIGHTS_EPOCH = [0]


def weights_changed(*_args) -> None:
    """Invalidate every WeightCache: the weights may have changed in a way their version
    counters do not show (FSDP2 all-gathers the unsharded parameter outside autograd into the
    same address step after step; a distributed checkpoint load writes the shards). Called
    after every optimizer step (a global post-step hook, below) and by loaders."""
    _WEIGHTS_EPOCH[0] += 1


register_optimizer_step_post_hook(weights_changed)


class WeightCache:
    """Holds a QuantizedWeight until one of the tensors it was built from changes (a load bumps
    the tensor's version counter) or the weights epoch moves (every optimizer step,
    `weights_changed`): one quantization per step, not per call."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: QuantizedWeight | None = None

    def get(self, tensors: tuple[torch.Tensor, ...], build) -> QuantizedWeight:
        per_tensor = [(t._version, t.data_ptr(), t.device, tuple(t.shape)) for t in tensors]
        key = (_WEIGHTS_EPOCH[0], *per_tensor)
        if key != self._key or self._value is None:
            self._value = build()
            self._key = key
        return self._value

    def clear(self) -> None:
        self._key = self._value = None
