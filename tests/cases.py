"""The byte-exact test suite of spec/formats.md §6.3, as data.

Used by the CPU reference tests and, on the GPU, by the kernel tests (issue: fast paths), so that
every implementation is compared with the reference on the same inputs.
"""

from __future__ import annotations

import math

import torch

# §6.3.1 awkward shapes: M not a multiple of 128, K not a multiple of 64, leading batch dims.
SHAPES_MXFP8 = [(1, 32), (3, 96), (16, 160), (128, 128), (130, 224), (993, 512), (2, 5, 64)]
SHAPES_NVFP4 = [(1, 16), (3, 48), (16, 80), (128, 128), (130, 208), (304, 304), (2, 5, 64)]
SHAPES_FP8_BLOCK = [(1, 128), (3, 256), (128, 128), (130, 384), (257, 256), (2, 130, 128)]
DTYPES = [torch.float32, torch.bfloat16]


def randn(shape, dtype, seed: int = 0, zero_row: bool = True, scale: float = 1.0) -> torch.Tensor:
    """Random normal in `dtype` with (optionally) one all-zero row, as spec §6.3.1 asks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32) * scale
    if zero_row and x.dim() >= 2 and x.shape[-2] > 1:
        x[..., 1, :] = 0.0
    return x.to(dtype)


def zeros(shape, dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def all_max(shape, dtype) -> torch.Tensor:
    """Every element finfo(dtype).max, alternating sign by column."""
    x = torch.full(shape, torch.finfo(dtype).max, dtype=dtype)
    x[..., 1::2] = -x[..., 1::2]
    return x


def boundary_pairs(shape, dtype, seed: int = 123) -> torch.Tensor:
    """TE's boundary case (§6.1): each row is linspace(-12, 12, K/2) -/+ 1e-3, interleaved."""
    rows, k = shape
    g = torch.Generator().manual_seed(seed)
    base = torch.linspace(-12.0, 12.0, k // 2)
    row = torch.stack((base - 1e-3, base + 1e-3), dim=-1).reshape(k)
    x = row.repeat(rows, 1)
    x = x * (1.0 + 0.01 * torch.rand((rows, 1), generator=g))  # vary rows a little
    return x.to(dtype)


def next_up(v: torch.Tensor, dtype) -> torch.Tensor:
    return torch.nextafter(v.to(dtype), torch.tensor(math.inf, dtype=dtype))


def next_down(v: torch.Tensor, dtype) -> torch.Tensor:
    return torch.nextafter(v.to(dtype), torch.tensor(-math.inf, dtype=dtype))


def mxfp8_pow2_edges(dtype, exponents=range(-20, 21, 4)) -> torch.Tensor:
    """[3 * len(exponents), 32]: blocks whose amax is exactly 448*2^k, and its two neighbouring
    representable values in `dtype` (the E8M0 round-up edge, §6.3.2). Other elements are small
    multiples of the amax so the element rounding is exercised too."""
    rows = []
    g = torch.Generator().manual_seed(7)
    for k in exponents:
        edge = torch.tensor(448.0 * 2.0**k, dtype=dtype)
        for amax in (next_down(edge, dtype), edge, next_up(edge, dtype)):
            row = (torch.rand(32, generator=g) * 2 - 1).to(dtype) * amax
            row[int(torch.randint(0, 32, (1,), generator=g))] = amax
            rows.append(row.to(dtype))
    return torch.stack(rows)


def nvfp4_underflow(dtype) -> torch.Tensor:
    """[4, 32]: row 0 holds the global amax (1.0) in its first block; rows 1-3 hold blocks whose
    amax / g_amax is about 1e-6 and 1e-7 (§6.3.3): their E4M3 scale rounds to 0x00."""
    x = torch.zeros(4, 32, dtype=torch.float32)
    x[0, :16] = torch.linspace(-1.0, 1.0, 16)
    x[1, :16] = 1e-6 * torch.linspace(0.1, 1.0, 16)
    x[2, 16:] = -1e-7 * torch.linspace(0.1, 1.0, 16)
    x[3, :16] = 1e-6
    x[3, 16:] = -1e-7
    return x.to(dtype)


def suite(shapes, dtypes=DTYPES):
    """(label, tensor) pairs: random normal (zero row), zeros, all-max, for each shape/dtype."""
    for dtype in dtypes:
        for i, shape in enumerate(shapes):
            name = f"{'x'.join(map(str, shape))}-{str(dtype).removeprefix('torch.')}"
            yield f"randn-{name}", randn(shape, dtype, seed=i)
            yield f"randn16-{name}", randn(shape, dtype, seed=100 + i, scale=16.0)
        yield f"zeros-{dtype}", zeros(shapes[-1], dtype)
        yield f"max-{dtype}", all_max(shapes[-1], dtype)
