"""The checksum of a weight record, computed on the device that holds it.

Every stored byte counts: each QTensor field (qdata, scale with any padding blocks, the NVFP4
global scale, 0-d or not) or the plain tensor, plus a header naming the record (its plan name),
the format, shape, axis and each field's dtype and shape. A checksum therefore belongs to one
name: a record sent under another tensor's name, with its own checksum, does not verify. The
bytes never leave the device; 64 bytes per field come back to the host.

    checksum = sha256(header ‖ 0x00 ‖ the fields' digests), 64 hex characters; the header is
               VERSION, the name (JSON-quoted), then one line for the value and one per field

A field's digest (`mxrl.kernels.digest.field_digests`: 64 bytes from every byte of one tensor,
the same integers on every device, in a few launches on CUDA) is computed level by level;
that module's docstring holds the algorithm, why it is exact and the collision argument.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

import torch

from mxrl.formats import QTensor
from mxrl.kernels.backend import Backend
from mxrl.kernels.digest import DIGEST_BYTES, VERSION, field_digests
from mxrl.weights.host import HostCopy
from mxrl.weights.record import VerifiedRecord, WeightRecord, WeightValue, stored_tensors

_HEADERS: dict[tuple, bytes] = {}  # header_key(...) -> header(...): the same records each sync
_MAX_HEADERS = 1 << 16


def _header_key(name: str, value: WeightValue) -> tuple | None:
    """Everything `header` reads of (name, value), as a dict key; None: not cached (a name that
    is not exactly a str, a value that is neither a QTensor nor a tensor: `_header` refuses
    them)."""
    if type(name) is not str or not isinstance(value, (QTensor, torch.Tensor)):
        return None
    if isinstance(value, QTensor):
        gs = value.global_scale
        return (
            name, value.fmt, tuple(value.shape), value.axis,
            value.qdata.dtype, tuple(value.qdata.shape), value.scale.dtype,
            tuple(value.scale.shape), None if gs is None else (gs.dtype, tuple(gs.shape)),
        )  # fmt: skip
    return (name, None, value.dtype, tuple(value.shape))


def header(name: str, value: WeightValue) -> bytes:
    """What the checksum binds besides the bytes: the record's name, its format, shape, axis,
    each field's dtype and shape (so whose bytes they are, and the length and meaning of every
    byte). The name is JSON-quoted: no name can forge the lines after it. Each distinct
    (name, layout) is formatted once (`_header_key`: every input of the text)."""
    key = _header_key(name, value)
    found = _HEADERS.get(key)  # (None is never stored)
    if found is not None:
        return found
    text = _header(name, value)
    if key is not None:
        if len(_HEADERS) >= _MAX_HEADERS:
            _HEADERS.clear()
        _HEADERS[key] = text
    return text


def _header(name: str, value: WeightValue) -> bytes:
    if not isinstance(name, str):
        raise TypeError(f"checksum: a record's name must be a str, got {type(name).__name__}")
    if isinstance(value, QTensor):
        lines = [f"qtensor|{value.fmt}|{tuple(value.shape)}|{value.axis}"]
    else:
        lines = [f"tensor|{value.dtype}|{tuple(value.shape)}"]
    for key, t in stored_tensors(value).items():
        lines.append(f"{key}|{t.dtype}|{tuple(t.shape)}")
    return "\n".join([VERSION, f"name|{json.dumps(name)}", *lines]).encode()


class PendingChecksums:
    """`checksums(names, values)` started without waiting for it: every field's digest is
    queued on its device (on CUDA: on the current stream, then copied into pinned host memory
    behind an event), so the host goes on at once. `wait()` reads the 64 bytes per field once
    they are there and returns the checksums. The values' tensors must not be written before
    `wait()` returns (a CUDA caller whose values were allocated on another stream records them
    on this one: `Tensor.record_stream`)."""

    def __init__(
        self,
        names: Sequence[str],
        values: Sequence[WeightValue],
        backend: Backend | str | None = None,
    ):
        if isinstance(names, str) or len(names) != len(values):
            raise TypeError(
                "checksums(names, values): one record name per value, got "
                f"{'a str' if isinstance(names, str) else len(names)} for {len(values)} value(s)"
            )
        self._headers = [header(n, v) for n, v in zip(names, values, strict=True)]
        by_device: dict[torch.device, list[tuple[int, int, torch.Tensor]]] = {}
        self._num_fields: list[int] = []
        for i, v in enumerate(values):
            fields = list(stored_tensors(v).values())
            self._num_fields.append(len(fields))
            for j, t in enumerate(fields):
                by_device.setdefault(t.device, []).append((i, j, t))
        self._groups: list[tuple[list[tuple[int, int]], HostCopy]] = []
        for group in by_device.values():
            digests = field_digests([t for _, _, t in group], backend)
            self._groups.append(([(i, j) for i, j, _ in group], HostCopy(digests)))

    def wait(self) -> list[str]:
        """The checksums, in the order of the values (blocks until their digests are read)."""
        parts = [[b""] * n for n in self._num_fields]
        for where, digests in self._groups:
            flat = digests.read().numpy().tobytes()
            for k, (i, j) in enumerate(where):
                parts[i][j] = flat[k * DIGEST_BYTES : (k + 1) * DIGEST_BYTES]
        return [
            hashlib.sha256(h + b"\0" + b"".join(p)).hexdigest()
            for h, p in zip(self._headers, parts, strict=True)
        ]


def checksums(
    names: Sequence[str], values: Sequence[WeightValue], backend: Backend | str | None = None
) -> list[str]:
    """The checksum of each (name, value) record, computed on the value's device: per device,
    every field of every value in one batch (a few kernel launches on CUDA) and one host read."""
    return PendingChecksums(names, values, backend).wait()


def verified_records(
    records: Sequence[WeightRecord], sums: Sequence[str]
) -> tuple[VerifiedRecord, ...]:
    """`records` as `VerifiedRecord`s, given `sums`: their checksums, computed in this process
    from their names and the bytes of their values (`checksums`, `PendingChecksums`). Raises
    ValueError naming the records whose checksum is not their `hash`."""
    bad = [(r, s) for r, s in zip(records, sums, strict=True) if s != r.hash]
    if bad:
        (first, got), more = bad[0], len(bad) - 1
        raise ValueError(
            f"{first.name}: checksum mismatch: it carries {first.hash[:16]}, its bytes under this "
            f"name give {got[:16]} (corrupted in transit or on disk, truncated, stale, or another "
            "tensor's record sent under this name)"
            + (f", and {more} more" if more else "")
            + "; the engine keeps its previous weights"
        )
    return tuple(VerifiedRecord(r.name, r.value, r.hash) for r in records)


def checksum(name: str, value: WeightValue, backend: Backend | str | None = None) -> str:
    """The checksum of one record, its name and its value (module docstring): 64 hex
    characters."""
    return checksums([name], [value], backend)[0]


def weights_digest(hashes: Iterable[tuple[str, str]]) -> str:
    """sha256 over the (name, checksum) pairs of a set of weights, in name order: what an engine
    holds (its verified `Engine.hashes`, `engine_digest` in the run record's `sync_verified`
    events and checkpoints) or an export produced (`Export.hashes`). Two sets hold the same bytes
    exactly when their digests are equal."""
    h = hashlib.sha256()
    for name, content in sorted(hashes):
        h.update(f"{name}\0{content}\n".encode())
    return h.hexdigest()
