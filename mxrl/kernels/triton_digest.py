"""The weight-sync checksum's levels (mxrl/kernels/digest.py) in Triton: every field of a
`checksums` call, every level, a handful of launches, reading each byte once at memory speed.
The reference (and CPU path) is `digest.field_digest_reference`; the integers are the same
(exact int32 sums: digest.py's docstring), so the digests are the same bytes.

    torch.ops.mxrl.checksum_digests(fields) -> int8 [64 * len(fields)]: the fields' digests

Legend: a *segment* is one field's input at one level: n bytes read as int8 rows of ROW = 2048
(m = max(1, ceil(n / ROW)) rows, the last one partial or, for n = 0, empty), projected onto
LANES = 16 int32 lanes: Y [m, 16] = X [m, 2048] @ C_l [2048, 16]. C is stored lane-major
(C_l^T, [16, 2048]) so that the int8 MMA's B operand is K-major, the layout Hopper's wgmma takes.

One launch per level covers every segment of that level (level 0: one per alignment class of
the fields' data pointers, usually one). A launch reads a table of int64 rows
(in_addr, n, out_addr, first_tile); program t finds its segment by binary search over
first_tile, then projects BLOCK_M whole rows (tiles of [BLOCK_M, BLOCK_K] int8, int8 tensor-core
dot, int32 accumulator) and the segment's last, partial row if it falls in its tile, with
byte-masked loads and an elementwise int32 sum: no padded copy. A segment's output is the next
level's input, in one workspace; a field's last level (one row) writes its 64-byte digest. The
addresses are raw pointers: every tensor behind them is alive when the kernels are queued, on
the current stream, and the caching allocator hands freed memory only to work queued later.

Why it runs at memory speed: the ALIGN hint (the largest power of two up to 16 dividing every
input address of the launch) lets the compiler load whole rows of aligned data as 16-byte
vectors, pipelined (num_stages) into shared memory with cp.async; the int8 MMA (wgmma on sm_90)
does 32 integer operations per byte read, far below the tensor cores' rate. Views at odd
addresses are read in place with narrower loads (correct, slower) rather than copied.
tests/kernels/test_digest_kernel.py checks the sm_90 PTX for the 16-byte cp.async and wgmma.
Imports triton: load it through the triton backend (`digest.field_digests`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from mxrl.kernels.digest import (
    DIGEST_BYTES,
    LANES,
    MAX_LEVELS,
    ROW_BYTES,
    coefficients_lane_major,
    num_rows,
)

# Exact whatever the values (any tiling gives the same integers); tuned for the H200's HBM.
DEFAULT_CONFIG = {"BLOCK_M": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}
_ALIGN = 16  # bytes: the vector width of an aligned load


@triton.jit(do_not_specialize=["num_segments"])
def digest_level_kernel(
    seg_ptr,  # int64 [num_segments, 4]: in_addr, n (bytes), out_addr, first tile; by first tile
    num_segments,
    coef_ptr,  # int8 [LANES, ROW]: this level's C^T
    ROW: tl.constexpr,
    LANES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALIGN: tl.constexpr,  # the input addresses are multiples of ALIGN bytes (16, 8, 4, 2, 1)
):
    t = tl.program_id(0).to(tl.int64)
    # the last segment whose first tile is <= t (branch-free binary search, first tiles ascend)
    seg = num_segments * 0
    count = num_segments
    while count > 1:
        half = count // 2
        mid = seg + half
        seg = tl.where(tl.load(seg_ptr + mid * 4 + 3) <= t, mid, seg)
        count -= half
    row_ptr = seg_ptr + seg * 4
    in_addr = tl.load(row_ptr)
    n = tl.load(row_ptr + 1)
    out_addr = tl.load(row_ptr + 2)
    first = tl.load(row_ptr + 3)
    # the launcher groups segments by alignment: full rows of aligned data load as 16-byte
    # vectors, pipelined into shared memory
    x_ptr = tl.multiple_of(in_addr.to(tl.pointer_type(tl.int8)), ALIGN)
    # workspace rows and digest slots are 64-byte aligned
    y_ptr = tl.multiple_of(out_addr.to(tl.pointer_type(tl.int32)), 16)

    full = n // ROW  # whole rows; a partial or empty last row follows when n % ROW or n == 0
    row0 = (t - first) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < full
    lanes = tl.arange(0, LANES)
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows * ROW
    c_lanes = coef_ptr + lanes * ROW

    acc = tl.zeros((BLOCK_M, LANES), dtype=tl.int32)
    for k in range(0, ROW, BLOCK_K):
        x = tl.load(x_rows[:, None] + (k + cols)[None, :], mask=row_ok[:, None], other=0)
        c = tl.load(c_lanes[:, None] + (k + cols)[None, :])
        acc = tl.dot(x, tl.trans(c), acc, out_dtype=tl.int32)
    tl.store(y_ptr + rows[:, None] * LANES + lanes[None, :], acc, mask=row_ok[:, None])

    last = tl.maximum((n + ROW - 1) // ROW, 1) - 1  # the index of the last row
    if (last == full) & (last >= row0) & (last < row0 + BLOCK_M):
        tail = n - full * ROW  # 0 <= tail < ROW bytes, the rest of the row counts as zeros
        acc_tail = tl.zeros((LANES,), dtype=tl.int32)
        for k in range(0, ROW, BLOCK_K):
            x = tl.load(x_ptr + full * ROW + k + cols, mask=k + cols < tail, other=0)
            c = tl.load(c_lanes[:, None] + (k + cols)[None, :])
            acc_tail += tl.sum(c.to(tl.int32) * x.to(tl.int32)[None, :], axis=1)
        tl.store(y_ptr + full * LANES + lanes, acc_tail)


def _alignment(address: int) -> int:
    """The largest power of two up to 16 that divides `address`."""
    return min(_ALIGN, address & -address) if address else _ALIGN


def _plan(nbytes: Sequence[int]) -> tuple[list[list[tuple[int, int]]], int]:
    """Per level, the (field, input bytes) of every field still above one row; and the
    workspace bytes all levels' intermediate outputs take."""
    levels: list[list[tuple[int, int]]] = []
    active = list(enumerate(nbytes))
    workspace = 0
    while active:
        levels.append(active)
        following = []
        for f, n in active:
            m = num_rows(n)
            if m > 1:
                following.append((f, DIGEST_BYTES * m))
                workspace += DIGEST_BYTES * m
        active = following
    if len(levels) > MAX_LEVELS:
        raise ValueError(f"checksum: a tensor of {max(nbytes)} bytes is too large")
    return levels, workspace


def launch_checksum_digests(
    fields: Sequence[torch.Tensor], config: dict | None = None
) -> torch.Tensor:
    """int8 [64 * len(fields)]: each field's digest, in order, on the fields' (one) device."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    block_m = cfg["BLOCK_M"]
    if not fields:
        return torch.empty(0, dtype=torch.int8)
    device = fields[0].device
    if any(t.device != device for t in fields):
        raise ValueError("checksum_digests: every field must be on one device")
    dense = [t if t.is_contiguous() else t.contiguous() for t in fields]
    nbytes = [t.numel() * t.element_size() for t in dense]
    levels, workspace_bytes = _plan(nbytes)
    coef = coefficients_lane_major(device)  # int8 [MAX_LEVELS, LANES, ROW]
    digests = torch.empty(len(dense) * DIGEST_BYTES, dtype=torch.int8, device=device)
    workspace = torch.empty(workspace_bytes, dtype=torch.int8, device=device)
    # the kernel tells the compiler its outputs are 16-byte aligned (allocations are)
    assert digests.data_ptr() % _ALIGN == 0 and workspace.data_ptr() % _ALIGN == 0

    # Addresses: level l of field f reads where level l-1 wrote (level 0: the field itself) and
    # writes the next region of the workspace, or its digest slot once one row is left.
    source = [t.data_ptr() for t in dense]
    table: list[list[int]] = []
    launches = []  # (first table row, segments, tiles, level, alignment)
    offset = 0
    for level, active in enumerate(levels):
        by_align: dict[int, list[tuple[int, int]]] = {}
        for f, n in active:  # level 0 reads the fields where they are: any alignment
            by_align.setdefault(_alignment(source[f]), []).append((f, n))
        for align, group in sorted(by_align.items(), reverse=True):
            start, tiles = len(table), 0
            for f, n in group:
                m = num_rows(n)
                if m > 1:
                    out = workspace.data_ptr() + offset
                    offset += DIGEST_BYTES * m
                else:
                    out = digests.data_ptr() + DIGEST_BYTES * f
                table.append([source[f], n, out, tiles])
                source[f] = out
                tiles += -(-m // block_m)  # (triton.cdiv from Python costs ~2 us a call)
            launches.append((start, len(group), tiles, level, align))
    assert offset == workspace_bytes, (offset, workspace_bytes)

    table_dev = torch.tensor(table, dtype=torch.int64)
    if device.type == "cuda":
        table_dev = table_dev.pin_memory().to(device, non_blocking=True)
    launch_cfg = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        for start, segments, tiles, level, align in launches:
            digest_level_kernel[(tiles,)](
                table_dev[start:], segments, coef[level],
                ROW=ROW_BYTES, LANES=LANES, BLOCK_M=block_m, BLOCK_K=cfg["BLOCK_K"],
                ALIGN=align, **launch_cfg,
            )  # fmt: skip
    # `dense` copies and `workspace` are freed on return, after the launches are queued: the
    # caching allocator hands their memory out again only to work queued after them
    return digests


@torch.library.custom_op("mxrl::checksum_digests", mutates_args=())
def checksum_digests(fields: list[torch.Tensor]) -> torch.Tensor:
    """The fields' 64-byte digests, concatenated (int8 [64 * len(fields)]); all on one device."""
    return launch_checksum_digests(fields)


@checksum_digests.register_fake
def _(fields: list[torch.Tensor]) -> torch.Tensor:
    device = fields[0].device if fields else torch.device("cpu")
    return torch.empty(len(fields) * DIGEST_BYTES, dtype=torch.int8, device=device)
