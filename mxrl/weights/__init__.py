"""The export format engine and sync share: master weights -> the bytes the plan says.

    from mxrl.weights import export, checksum
    for bucket in export(model, plan, step=step):   # quantized on the master's device
        for record in bucket.records:               # WeightRecord(name, value, hash)
            assert checksum(record.name, record.value) == record.hash

record.py (WeightRecord), digest.py (the device-side checksum over a record's name and bytes; a field's
levels and their collision argument are mxrl/kernels/digest.py), check.py (a record's fields and global scales against the plan),
export.py (the one export path: per-spec quantization), finite.py (its NaN/Inf check, read at
once or queued), host.py (results copied to the host, read later), buckets.py (bucketed
export and its QuantizationEvent, event.py), checkpoint.py (quantized checkpoints on disk, with
sha256 per shard), convert.py (`mxrl convert`), fp8_source.py (an FP8
checkpoint's bytes against the plan's). docs/sync.md describes them.
"""

from mxrl.weights.buckets import DEFAULT_BUCKET_BYTES, WHOLE_UPDATE, Bucket, Export, export
from mxrl.weights.check import GlobalScaleCheck, check_global_scales, check_record
from mxrl.weights.convert import convert_checkpoint
from mxrl.weights.digest import PendingChecksums, checksum, checksums, verified_records
from mxrl.weights.event import QuantizationEvent
from mxrl.weights.export import check_finite, export_weights, quantized_values
from mxrl.weights.quantized_checkpoint import (
    MANIFEST_NAME,
    PLAN_NAME,
    read_quantized_checkpoint,
    write_quantized_checkpoint,
)
from mxrl.weights.record import VerifiedRecord, WeightRecord, WeightValue, stored_tensors

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "MANIFEST_NAME",
    "PLAN_NAME",
    "WHOLE_UPDATE",
    "Bucket",
    "Export",
    "GlobalScaleCheck",
    "PendingChecksums",
    "QuantizationEvent",
    "VerifiedRecord",
    "WeightRecord",
    "WeightValue",
    "check_finite",
    "check_global_scales",
    "check_record",
    "checksum",
    "checksums",
    "convert_checkpoint",
    "export",
    "export_weights",
    "quantized_values",
    "read_quantized_checkpoint",
    "stored_tensors",
    "verified_records",
    "write_quantized_checkpoint",
]
