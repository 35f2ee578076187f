"""WeightRecord: one exported tensor as engines, transports and checkpoints carry it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxrl.formats import QTensor

WeightValue = QTensor | torch.Tensor


@dataclass(frozen=True)
class WeightRecord:
    """One exported tensor: its plan name, its value (QTensor when quantized) and the checksum
    of its bytes (`mxrl.weights.digest`), which every receiver recomputes."""

    name: str
    value: WeightValue
    hash: str

    @property
    def nbytes(self) -> int:
        return value_nbytes(self.value)


@dataclass(frozen=True)
class VerifiedRecord(WeightRecord):
    """A record whose checksum this process has recomputed from its value's bytes and found
    equal to `hash` (made only by `mxrl.weights.digest.verified_records`), its tensors written
    by nothing since: `Engine.load_weights` does not compute its checksum again. A receiver
    that checks each bucket as it arrives (`BroadcastReceiver`) hands these over, so every
    record is checksummed once on send and once on receive."""


def stored_tensors(value: WeightValue) -> dict[str, torch.Tensor]:
    """Every tensor a value stores, in a fixed order: QTensor qdata, scale (and global_scale),
    or the plain tensor under the key ""."""
    return value.tensors() if isinstance(value, QTensor) else {"": value}


def value_nbytes(value: WeightValue) -> int:
    """Bytes held: quantized data, block scales and global scales, or the plain tensor."""
    return sum(t.numel() * t.element_size() for t in stored_tensors(value).values())
