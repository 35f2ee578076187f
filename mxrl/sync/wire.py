"""The sync wire format (version 5): what `mxrl.sync.broadcast` broadcasts, as bytes.

Bucket by bucket, two broadcasts per bucket from `src`:

1. meta, uint8[META_BYTES = 64 KiB], fixed size, so a receiver always knows how much follows,
   even when it cannot use what arrives: int64[4] (little-endian) wire version, flags (1 = last
   bucket, 2 = the sender aborted), header length, payload length; the sha256 of the header (32
   bytes); then the header itself when it fits the remaining META_BYTES - 64 bytes (zero-padded).
   A longer header follows as a broadcast of its own, uint8[header length].
2. payload, one flat uint8 bucket: every field's bytes, each at a 16-byte-aligned offset.

The header is the JSON of the bucket (index, last, num_buckets, plan hash, step, the
QuantizationEvent on the last bucket) and of each record: name, checksum, and its fields
(QTensor qdata / scale / global_scale, or one plain tensor) as dtype, shape, offset and byte
count in the payload. A receiver reads each meta on the host before it can queue the payload's
receive, and the meta of bucket k+1 travels behind payload k (one communicator, one stream): one
host round trip per bucket, during which the wire waits.

Scheduled: every payload back to back, then one meta (flag 1) whose header, the trailer, holds
the plan hash, the step, the event and every record's checksum in layout order (2 = aborted, as
above). The receivers queue the receives of all payloads at once (sizes from the layout) and
build each bucket's records as views of its payload from the layout, so the wire never waits on
a receiver's host. The sender checks each packed bucket against the layout; an export that is
laid out otherwise, ends early or fails mid-way still sends every payload the receivers queued
(zeros), then aborts: every rank keeps its weights, and the sender forgets the layout.

(Wire 4 carried checksums of the bytes alone, without the record's name; 3 had only the
per-bucket mode; 2 sent the meta as int64[8], the header always on its own; 1 carried sha256
content hashes.) `PayloadLayout` is what both ends remember of an update sent
bucket by bucket.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from typing import Any

import torch

from mxrl.formats import QTensor
from mxrl.weights import Bucket, QuantizationEvent, WeightRecord

# 5: the records' checksums cover their names (mxrl-checksum-v2); 4: the layout agreement and
# the scheduled mode; 3: the header inline in a fixed 64 KiB meta; 2: records carry mxrl.weights
# checksums (meta int64[8], header on its own); 1: sha256 hashes
WIRE_VERSION = 5
FLAG_LAST = 1
FLAG_ABORT = 2
META_BYTES = 64 * 1024  # the meta broadcast: HEAD_BYTES, then the header if it fits
HEAD = struct.Struct("<4q32s")  # wire version, flags, header length, payload length, sha256
HEAD_BYTES = HEAD.size  # 64
_ALIGN = 16
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.uint8,
        torch.int8,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e8m0fnu,
    )
}


# --- wire format -------------------------------------------------------------------------------
def pack_bucket(bucket: Bucket, device: torch.device | str = "cpu") -> tuple[bytes, torch.Tensor]:
    """(header JSON bytes, flat uint8 payload on `device`) for one bucket."""
    fields: list[tuple[torch.Tensor, int]] = []
    records: list[dict[str, Any]] = []
    offset = 0
    for record in bucket.records:
        value = record.value
        tensors = value.tensors() if isinstance(value, QTensor) else {"": value}
        described = []
        for key, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            described.append(
                {
                    "key": key,
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "offset": offset,
                    "nbytes": nbytes,
                }
            )
            fields.append((t, offset))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        records.append(
            {
                "name": record.name,
                "hash": record.hash,
                "qtensor": isinstance(value, QTensor),
                "fields": described,
            }
        )
    payload = torch.zeros(offset, dtype=torch.uint8, device=device)
    for t, off in fields:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        payload[off : off + flat.numel()].copy_(flat)
    header = {
        "wire": WIRE_VERSION,
        "index": bucket.index,
        "last": bucket.last,
        "num_buckets": bucket.num_buckets,
        "plan_hash": bucket.plan_hash,
        "step": bucket.step,
        "event": bucket.event.to_dict() if bucket.event is not None else None,
        "payload_bytes": offset,
        "records": records,
    }
    return json.dumps(header, separators=(",", ":")).encode(), payload


def unpack_bucket(header: bytes, payload: torch.Tensor) -> Bucket:
    """Rebuild a bucket from `pack_bucket`'s output; the tensors are views of `payload`.
    Raises ValueError for a header that does not describe this payload."""
    try:
        h = json.loads(header.decode())
        if h["wire"] != WIRE_VERSION:
            raise ValueError(f"wire version {h['wire']!r}, this mxrl speaks {WIRE_VERSION}")
        if h["payload_bytes"] != payload.numel():
            raise ValueError(
                f"header says {h['payload_bytes']} payload bytes, got {payload.numel()}"
            )
        records = tuple(record_views(r, payload) for r in h["records"])
        event = QuantizationEvent.from_dict(h["event"]) if h["event"] is not None else None
        return Bucket(
            index=int(h["index"]),
            plan_hash=str(h["plan_hash"]),
            records=records,
            last=bool(h["last"]),
            num_buckets=h["num_buckets"],
            step=int(h["step"]),
            event=event,
        )
    except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed bucket header ({e!r}); the update is refused") from None


def record_views(r: dict[str, Any], payload: torch.Tensor) -> WeightRecord:
    name = r["name"]
    tensors = {}
    for f in r["fields"]:
        dtype = _DTYPES.get(f["dtype"])
        if dtype is None:
            raise ValueError(f"{name}: dtype {f['dtype']!r} is not one a weight record uses")
        shape = tuple(int(d) for d in f["shape"])
        nbytes, off = int(f["nbytes"]), int(f["offset"])
        if (
            nbytes != math.prod(shape) * dtype.itemsize
            or off % _ALIGN
            or off + nbytes > len(payload)
        ):
            raise ValueError(f"{name}.{f['key']}: field does not fit the payload")
        tensors[f"{name}.{f['key']}" if f["key"] else name] = (
            payload[off : off + nbytes].view(dtype).reshape(shape)
        )
    if not r["qtensor"]:
        return WeightRecord(name, tensors[name], str(r["hash"]))
    try:
        value = QTensor.from_state_dict(tensors, name)
    except (KeyError, TypeError, ValueError) as e:  # fields no format stores this way
        raise ValueError(
            f"{name}: its fields are not a QTensor ({e}); the update is refused"
        ) from None
    return WeightRecord(name, value, str(r["hash"]))


def meta_message(flags: int, header: bytes, payload_len: int, device: torch.device) -> torch.Tensor:
    """The meta of one bucket (module docstring), uint8[META_BYTES] on `device`."""
    meta = bytearray(META_BYTES)
    digest = hashlib.sha256(header).digest()
    HEAD.pack_into(meta, 0, WIRE_VERSION, flags, len(header), payload_len, digest)
    if fits_inline(len(header)):
        meta[HEAD_BYTES : HEAD_BYTES + len(header)] = header
    return torch.frombuffer(meta, dtype=torch.uint8).to(device)


def fits_inline(header_len: int) -> bool:
    """Whether a header of this length travels inside the meta."""
    return header_len <= META_BYTES - HEAD_BYTES


# --- the layout of an update: what both ends remember for the scheduled mode ---------------------
@dataclasses.dataclass(frozen=True)
class PayloadLayout:
    """Where every field of an update lies in its payloads: the bucket headers without what
    depends on the weights' values (checksums, step, event). It follows from the plan, the
    bucket size and the bf16 dtype alone, so the updates of one run share it. id: 16 bytes of the sha256 of the
    buckets' JSON."""

    id: bytes
    plan_hash: str
    buckets: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, headers: list[dict[str, Any]]) -> PayloadLayout:
        buckets = tuple(bucket_layout(h) for h in headers)
        text = json.dumps(buckets, separators=(",", ":")).encode()
        return cls(hashlib.sha256(text).digest()[:16], str(headers[0]["plan_hash"]), buckets)


def bucket_layout(h: dict[str, Any]) -> dict[str, Any]:
    records = [{k: v for k, v in r.items() if k != "hash"} for r in h["records"]]
    return {"plan_hash": h["plan_hash"], "payload_bytes": h["payload_bytes"], "records": records}
