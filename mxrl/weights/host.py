"""A device tensor's copy to the host, queued now and read later.

    copy = HostCopy(flags)      # CUDA: into pinned memory behind an event, the host goes on
    ...                         # more work queued on the device
    copy.read()                 # waits for that event alone, then the host tensor

`PendingChecksums` (the update's digests) and `FiniteCheck` (its NaN/Inf flags) read their
results this way, so each costs one host wait where its caller wants it.
"""

from __future__ import annotations

import torch


class HostCopy:
    """`t` on the host: on CUDA copied into pinned memory behind an event recorded on its
    device's current stream (`read` waits for that event, not for work queued after it); a
    CPU tensor is itself; another device's is copied at once."""

    def __init__(self, t: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(t.device))
            t = host
        elif t.device.type != "cpu":
            t = t.cpu()
        self._host = t

    def read(self) -> torch.Tensor:
        """The host tensor, once the copy is done."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
