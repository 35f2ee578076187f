"""The Python garbage collector around a rollout.

`Engine.generate` runs with the collector off (`collector_paused`): its decode loop makes Python
objects at every step (the scheduler's rows, each request's routing record), and the collector,
set off every ~700 tracked allocations, walks the young ones each time and the whole heap now
and then (157 ms a full walk of the ~310k objects of a process holding torch and the tiny model,
on a CPU). A rollout makes no reference cycles to reclaim: a tiny-model rollout of 32 x 8
requests with the collector off left no unreachable object (`benchmarks/gc_rollout.py`;
`tests/engine/test_collector.py` checks a smaller one).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off inside the block, its previous state (on or off) restored after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
