"""The weight checksum's levels: a field's bytes to a 64-byte digest, the same integers on
every device. `mxrl.weights.digest` binds the digests of a record's fields to its name,
format and shape (the checksum); `mxrl/kernels/triton_digest.py` is the fast path of
`field_digests`.

Algorithm (one field of n bytes):

    level 0 input: the bytes read as int8 (a bijection of 0..255), in rows of ROW_BYTES = 2048,
                   the last row zero-padded                                  X  [m, 2048] int8
    one level:     Y = X @ C_l with C_l [2048, LANES = 16] int8 coefficients  Y  [m, 16]  int32
                   (SHAKE-128 of "mxrl-checksum-v2 level l", a fresh matrix per level); the
                   64 * m bytes of Y (little-endian int32) are the next level's input
    the field's digest: Y once a level leaves one row (64 bytes); 2048 -> 64 bytes per row, so
                   a 1 GiB field takes 5 levels, each reading 1/32 of the previous one's bytes

    the checksum (mxrl.weights.digest): sha256 over a header naming the record and its
               fields' digests

Why it is the same on every device: every product is at most 128 * 128 = 2^14 in magnitude
and a row sums 2048 of them, so |Y| <= 2^25 < 2^31: int32 arithmetic that never overflows is
exact, and exact integer sums do not depend on their order. The CPU, cuBLAS's int8 GEMM, the
Triton kernel's int8 dots (any tile shape), split-K and the elementwise paths (`_project_exact`,
the kernel's last row) all give the same integers.

Collision argument. Take two different byte strings of one length n (the header holds n through
dtype and shape, so strings of different lengths never compare). At level 0 their difference
D = X - X' is a nonzero integer matrix (entries in [-255, 255]); pick a row r with D[r, i] != 0.
Lane j collides only if sum_i D[r, i] * C[i, j] = 0; fixing every coefficient but C[i, j], one
value of C[i, j] out of 256 at most satisfies that, so it happens with probability <= 1/256, and
the 16 lanes, independent columns, all collide with probability <= 2^-128. If Y != Y', their
bytes differ and the next level, with an independent matrix, starts over: the chance that two
different fields get one digest is <= levels * 2^-128 (levels <= 8). The probability is over
the choice of the coefficients, so it covers every corruption that does not know them: bit
flips, truncation (another length is another header; a shortened payload is zero-filled or
refused), reordered rows or fields (positions meet different coefficients), records swapped or
renamed (the name is in the header, so a record's checksum is another name's only by a sha256
collision), stale buffers holding an older update. It is not a defence against someone who reads
this file and forges bytes: anyone who can run this code computes a matching checksum for any
bytes and name (on-disk checkpoints keep sha256 per shard; receivers also check every record's
fields against the plan and the NVFP4 global scales' values, `mxrl.weights.check`).

Cost. On CUDA with triton (the default backend there; `backend=` as in
`mxrl.kernels.select_backend`), `mxrl/kernels/triton_digest.py` reads each byte once, whole rows
as 16-byte vectors pipelined into shared memory, and projects them with int8 tensor-core dots
(32 integer operations per byte, far below the tensor cores' rate), so the level-0 pass is meant
to run at memory bandwidth (target >= 2.5 TB/s on an H200, against ~340 GB/s for the cuBLAS
path; `python -m tests.kernels.test_digest_kernel --bench` measures it). One launch per level
covers every field of a `checksums` call on that device (level 0: one per alignment class of the
data pointers, usually one); the partial last row is read with masked loads and unaligned views
in place: no copy of the data, no host round trip until the digests (64 bytes per field) are
read. Extra memory: the later levels' inputs, 1/32 of the bytes plus 1/32 of that. The
reference (`field_digest_reference`: the CPU path, and CUDA without triton) runs
`torch._int_mm` level by level, copying the zero-padded last row and any unaligned CUDA input.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Sequence

import torch

from mxrl.kernels.backend import Backend, Kernels, backend_for

logger = logging.getLogger(__name__)

VERSION = "mxrl-checksum-v2"  # v2: the record's name is in the header (v1: bytes only)
ROW_BYTES = 2048
LANES = 16
DIGEST_BYTES = 4 * LANES
MAX_LEVELS = 8  # 2048 * 32**7 bytes = 64 TiB per field
_EXACT_ROWS = 64  # rows per chunk of the elementwise path: [64, 2048, 16] int32 = 8 MiB
_ALIGN = 16  # cuBLAS int8 GEMM operands: 16-byte aligned


@functools.cache
def _coefficients_host(level: int) -> torch.Tensor:
    raw = hashlib.shake_128(f"{VERSION} level {level}".encode()).digest(ROW_BYTES * LANES)
    return torch.frombuffer(bytearray(raw), dtype=torch.int8).view(ROW_BYTES, LANES)


_DEVICE_COEFFICIENTS: dict[tuple[torch.device, int], torch.Tensor] = {}
_LANE_MAJOR: dict[torch.device, torch.Tensor] = {}
_INT_MM: dict[torch.device, bool] = {}


def _coefficients(level: int, device: torch.device) -> torch.Tensor:
    key = (device, level)
    if key not in _DEVICE_COEFFICIENTS:
        _DEVICE_COEFFICIENTS[key] = _coefficients_host(level).to(device)
    return _DEVICE_COEFFICIENTS[key]


def coefficients_lane_major(device: torch.device) -> torch.Tensor:
    """Every level's C_l transposed: int8 [MAX_LEVELS, LANES, ROW_BYTES] on `device` (the
    kernel's layout)."""
    if device not in _LANE_MAJOR:
        c = torch.stack([_coefficients_host(level).t() for level in range(MAX_LEVELS)])
        _LANE_MAJOR[device] = c.contiguous().to(device)
    return _LANE_MAJOR[device]


def num_rows(nbytes: int) -> int:
    """Rows of one level's input of `nbytes` bytes (at least one: an empty field has one zero
    row)."""
    return max(1, -(-nbytes // ROW_BYTES))


def _int_mm_available(device: torch.device) -> bool:
    """Whether torch's int8 GEMM runs on this device (probed once per device)."""
    if device not in _INT_MM:
        try:
            a = torch.zeros(32, ROW_BYTES, dtype=torch.int8, device=device)
            torch._int_mm(a, _coefficients(0, device))
            _INT_MM[device] = True
        except (RuntimeError, NotImplementedError) as err:
            logger.warning("checksum: no int8 GEMM on %s (%s); elementwise path", device, err)
            _INT_MM[device] = False
    return _INT_MM[device]


def _project_exact(rows: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """rows [m, 2048] int8 @ c [2048, 16] int8 -> int32, elementwise in chunks: the same
    integers as the GEMM (exact, module docstring)."""
    c32 = c.to(torch.int32)
    out = [
        (chunk.to(torch.int32).unsqueeze(-1) * c32).sum(1).to(torch.int32)
        for chunk in rows.split(_EXACT_ROWS)
    ]
    return torch.cat(out) if len(out) > 1 else out[0]


def _project(rows: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    # cuBLAS takes more than 16 rows; either path gives the same integers
    if (rows.device.type == "cuda" and rows.shape[0] <= 16) or not _int_mm_available(rows.device):
        return _project_exact(rows, c)
    return torch._int_mm(rows, c)


def _level(x: torch.Tensor, level: int) -> torch.Tensor:
    """One level: flat int8 [n] -> flat int8 [64 * ceil(n / 2048)] (at least one row)."""
    c = _coefficients(level, x.device)
    full = x.numel() // ROW_BYTES
    parts = []
    if full:
        parts.append(_project(x[: full * ROW_BYTES].view(full, ROW_BYTES), c))
    tail = x.numel() - full * ROW_BYTES
    if tail or not full:
        row = torch.zeros(1, ROW_BYTES, dtype=torch.int8, device=x.device)
        row[0, :tail] = x[full * ROW_BYTES :]
        parts.append(_project(row, c))
    y = torch.cat(parts) if len(parts) > 1 else parts[0]
    return y.contiguous().view(torch.int8).reshape(-1)


def field_digest_reference(t: torch.Tensor) -> torch.Tensor:
    """The 64-byte digest (int8 [64], on t's device) of every byte of one tensor, level by level
    in PyTorch: the CPU path and the oracle of the Triton kernel."""
    x = t.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    x = x.reshape(-1).view(torch.uint8).view(torch.int8)
    if x.device.type == "cuda" and x.numel() and x.data_ptr() % _ALIGN:
        x = x.clone()
    for level in range(MAX_LEVELS):
        x = _level(x, level)
        if x.numel() == DIGEST_BYTES:
            return x
    raise ValueError(f"checksum: a tensor of {t.numel() * t.element_size()} bytes is too large")


def field_digests(
    fields: Sequence[torch.Tensor], backend: Kernels | Backend | str | None = None
) -> torch.Tensor:
    """The fields' digests, concatenated (int8 [64 * len(fields)]), all on the fields' device.
    backend: as `mxrl.kernels.select_backend` (None: triton on CUDA when importable, else the
    reference); both give the same bytes."""
    if not fields:
        return torch.empty(0, dtype=torch.int8)
    device = fields[0].device
    if backend_for(backend, device) is Backend.TRITON:
        from mxrl.kernels import triton_digest  # noqa: F401  (registers the op)

        # records hold plain tensors without autograd history: a detach only for the others
        plain = [
            t if type(t) is torch.Tensor and not t.requires_grad else t.detach() for t in fields
        ]
        return torch.ops.mxrl.checksum_digests(plain)
    return torch.cat([field_digest_reference(t) for t in fields])
