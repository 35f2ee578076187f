"""What the kernel tests compare: each kernel variant, its reference call, and its inputs
(spec §6.3 suite from tests/cases.py, edge cases, NaN/Inf). Shared by the CPU interpreter tests
and the GPU tier so that both check the same things."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from mxrl.formats import QTensor
from mxrl.formats import quantize as reference_quantize
from mxrl.formats.constants import FLT_MAX
from mxrl.kernels import quantize, quantize_mxfp8_both
from tests import cases
from tests.formats import test_finite_range as FR
from tests.numerics import assert_qtensor_bytes_equal


@dataclass(frozen=True)
class Variant:
    """One kernel configuration: `fmt` and the quantize() kwargs it is called with.
    `amax` builds a caller global amax from x ("scalar", "rows" [..., 1], "lead" [E, 1, 1])."""

    name: str
    fmt: str
    kwargs: dict = field(default_factory=dict)
    amax: str | None = None
    both: bool = False  # quantize_mxfp8_both: row-wise + column-wise from one kernel

    def accepts(self, x: torch.Tensor) -> bool:
        if self.fmt == "mxfp8" and (self.both or self.kwargs.get("axis") == 0):
            return x.dim() >= 2 and x.shape[-2] % 32 == 0
        if self.fmt == "fp8_block" and self.kwargs.get("block", (128, 128))[0] > 1:
            return x.dim() >= 2
        if self.amax == "lead":
            return x.dim() >= 3
        return True

    def call_kwargs(self, x: torch.Tensor) -> dict:
        kwargs = dict(self.kwargs)
        if self.fmt == "mxfp8" and kwargs.get("axis") == 0:
            kwargs["axis"] = x.dim() - 2
        if self.amax is not None:
            # the caller's amax is over the finite elements, as quantize's own (NaN/Inf -> 0)
            xf = x.float()
            mag = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf))
            if self.amax == "scalar":
                # not the tensor's own amax (capped: a global_amax must be finite)
                kwargs["global_amax"] = torch.clamp(mag.amax() * 1.25, max=FLT_MAX)
            elif self.amax == "rows":
                kwargs["global_amax"] = mag.amax(dim=-1, keepdim=True)
            else:
                kwargs["global_amax"] = mag.flatten(1).amax(dim=1).reshape(-1, *[1] * (x.dim() - 1))
        return kwargs


VARIANTS = [
    Variant("mxfp8-row", "mxfp8"),
    Variant("mxfp8-col", "mxfp8", {"axis": 0}),
    Variant("mxfp8-both", "mxfp8", both=True),
    Variant("nvfp4-tensor", "nvfp4"),
    Variant("nvfp4-token", "nvfp4", {"per_token": True}),
    Variant("nvfp4-amax-scalar", "nvfp4", amax="scalar"),
    Variant("nvfp4-amax-rows", "nvfp4", amax="rows"),
    Variant("nvfp4-amax-lead", "nvfp4", amax="lead"),
    Variant("nvfp4-4over6-tensor", "nvfp4", {"scale_mode": "4over6"}),
    Variant("nvfp4-4over6-token", "nvfp4", {"per_token": True, "scale_mode": "4over6"}),
    Variant("nvfp4-4over6-amax-scalar", "nvfp4", {"scale_mode": "4over6"}, amax="scalar"),
    Variant("nvfp4-4over6-amax-rows", "nvfp4", {"scale_mode": "4over6"}, amax="rows"),
    Variant("nvfp4-4over6-amax-lead", "nvfp4", {"scale_mode": "4over6"}, amax="lead"),
    Variant("fp8-128x128", "fp8_block"),
    Variant("fp8-128x128-ue8m0", "fp8_block", {"scale_mode": "ue8m0"}),
    Variant("fp8-1x128", "fp8_block", {"block": (1, 128)}),
    Variant("fp8-1x128-ue8m0", "fp8_block", {"block": (1, 128), "scale_mode": "ue8m0"}),
]
VARIANT_IDS = [v.name for v in VARIANTS]

SHAPES = {"mxfp8": cases.SHAPES_MXFP8, "nvfp4": cases.SHAPES_NVFP4}
SHAPES["fp8_block"] = cases.SHAPES_FP8_BLOCK
# Shapes with 32-row multiples for the column-wise copies (the §6.3 list has few).
COL_SHAPES = [(32, 32), (64, 96), (128, 160), (992, 512), (2, 64, 64)]


def with_non_finite(x: torch.Tensor, seed: int = 5) -> torch.Tensor:
    """x with NaN, +Inf and -Inf at a few places, plus one all-NaN 32-element row segment.
    The reference's policy (docs/formats.md, "Non-finite inputs"): every amax is over the
    finite elements; MXFP8 / block FP8 store NaN and ±Inf as 0x7F; NVFP4 stores its E2M1 codes
    (NaN -> 0x7, ±Inf -> ±6) and marks the 16-block with scale 0x7F. The kernels must give
    those bytes, including the all-NaN segment (amax 0)."""
    g = torch.Generator().manual_seed(seed)
    y = x.clone()
    flat = y.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[:9]
    flat[idx[:3]] = float("nan")
    flat[idx[3:6]] = float("inf")
    flat[idx[6:]] = -float("inf")
    if y.shape[-1] >= 32:
        y.reshape(-1, y.shape[-1])[0, :32] = float("nan")
    return y


def inputs(variant: Variant) -> Iterator[tuple[str, torch.Tensor]]:
    """(label, CPU tensor) pairs for one variant: the §6.3 suite and the format's edges."""
    columns = variant.fmt == "mxfp8" and (variant.both or variant.kwargs.get("axis") == 0)
    yield from cases.suite(COL_SHAPES if columns else SHAPES[variant.fmt])
    for d in cases.DTYPES:
        yield f"boundary-{d}", cases.boundary_pairs((32, 128), d)
        if variant.fmt == "mxfp8":
            edges = cases.mxfp8_pow2_edges(d)  # [33, 32]: one edge block per row
            # column-wise: the transpose puts each edge block in a column (32 of the 33)
            yield f"pow2-{d}", edges.t()[:, :32].contiguous() if columns else edges
        if variant.fmt == "nvfp4":
            yield f"underflow-{d}", cases.nvfp4_underflow(d)
        yield f"nonfinite-{d}", with_non_finite(cases.randn((64, 256), d, seed=9, scale=4.0))
        # the top of the fp32 range: elements at 2^120 saturate to 240 (test_finite_range.py)
        yield f"top-{d}", FR.edge_input(d, FR.TOP if d == torch.float32 else FR.BF16_MAX)
    yield "fp16", cases.randn((64, 128), torch.float16, seed=11, scale=8.0)
    yield "non-contiguous", cases.randn((128, 96), torch.bfloat16, seed=12).t()


def run_kernel(variant: Variant, x: torch.Tensor, backend: str = "triton"):
    kwargs = variant.call_kwargs(x)
    if variant.both:
        return quantize_mxfp8_both(x, backend=backend)
    return quantize(x, variant.fmt, backend=backend, **kwargs)


def run_reference(variant: Variant, x: torch.Tensor):
    kwargs = variant.call_kwargs(x)
    if variant.both:
        ref_row = reference_quantize(x, "mxfp8")
        return ref_row, reference_quantize(x, "mxfp8", axis=x.dim() - 2)
    return reference_quantize(x, variant.fmt, **kwargs)


def assert_same_bytes(variant: Variant, got, want, label: str) -> None:
    if isinstance(want, QTensor):
        got, want = (got,), (want,)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_qtensor_bytes_equal(g.to("cpu"), w.to("cpu"), f"{variant.name}[{i}] {label}")
