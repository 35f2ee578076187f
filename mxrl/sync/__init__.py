"""Trainer -> engine weight sync: quantize per plan, bucket, hash, transport, verify; and
quantized checkpoints written through the same export path.

    from mxrl.sync import InProcessTransport, export
    report = InProcessTransport(engine).send(export(model, engine.plan, step=step))
    report.event.sqnr_db  # per-layer SQNR of this quantization event

docs/sync.md describes buckets, hashes, events, the transports and the checkpoint format.
"""

from mxrl.sync.checkpoint import (
    convert_checkpoint,
    load_engine_from_checkpoint,
    read_quantized_checkpoint,
    write_quantized_checkpoint,
)
from mxrl.sync.distributed import DistributedReceiver, DistributedSender, pack_bucket, unpack_bucket
from mxrl.sync.export import DEFAULT_BUCKET_BYTES, Bucket, Export, QuantizationEvent, export
from mxrl.sync.transport import InProcessTransport, SyncReport, apply_update

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "DistributedReceiver",
    "DistributedSender",
    "Export",
    "InProcessTransport",
    "QuantizationEvent",
    "SyncReport",
    "apply_update",
    "convert_checkpoint",
    "export",
    "load_engine_from_checkpoint",
    "pack_bucket",
    "read_quantized_checkpoint",
    "unpack_bucket",
    "write_quantized_checkpoint",
]
