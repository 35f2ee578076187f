"""Trainer -> engine weight sync: the transports. The export format they carry (records,
checksums, buckets, quantization events, quantized checkpoints) is `mxrl.weights`.

    from mxrl.sync import InProcessTransport
    from mxrl.weights import export
    report = InProcessTransport(engine).send(export(model, engine.plan, step=step))
    report.event.sqnr_db  # per-layer SQNR of this quantization event

docs/sync.md describes buckets, checksums, events, the transports and the checkpoint format.
"""

from mxrl.sync.broadcast import BroadcastSender
from mxrl.sync.broadcast_receive import BroadcastReceiver
from mxrl.sync.transport import InProcessTransport, SyncReport, apply_update
from mxrl.sync.wire import pack_bucket, unpack_bucket

__all__ = [
    "BroadcastReceiver",
    "BroadcastSender",
    "InProcessTransport",
    "SyncReport",
    "apply_update",
    "pack_bucket",
    "unpack_bucket",
]
