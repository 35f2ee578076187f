"""The SQNR's terms from the quantizer's own read (`mxrl.kernels.quantize_measured`, Triton
under the interpreter): the codes and scales are `quantize`'s, byte for byte, and the parts add
up to the definitions (float64 sums over the reference's dequantization) per tensor and, for
3-D expert stacks, per expert: the groups the export's sampled SQNR takes (`SqnrMeter`)."""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import dequantize
from mxrl.kernels import Backend, quantize, quantize_measured
from tests.kernels.test_decode_gemm import interpreter


def _definition(q, master) -> torch.Tensor:
    """[sum w^2, sum (w - dequantize(q))^2], float64 throughout, from the reference."""
    w = master.double()
    err = w - dequantize(q).double()
    return torch.stack([w.square().sum(), err.square().sum()])


def _bytes(q) -> list[torch.Tensor]:
    fields = [q.qdata, q.scale] + ([q.global_scale] if q.global_scale is not None else [])
    return [f.reshape(-1).contiguous().view(torch.uint8) for f in fields]


# (fmt, shape, options, groups): groups is the parts' first dim, E where each expert's
# programs are its own (every layout the export quantizes), 1 where a program crosses two
CASES = [
    ("fp8_block", (3, 256, 384), {"block": (128, 128)}, 3),
    ("fp8_block", (3, 200, 256), {"block": (128, 128)}, 3),  # a partial row block per matrix
    ("fp8_block", (256, 384), {"block": (128, 128)}, 1),
    ("fp8_block", (2, 48, 256), {"block": (1, 128)}, 2),  # 16 rows a program
    ("fp8_block", (2, 40, 256), {"block": (1, 128)}, 1),
    ("mxfp8", (3, 64, 128), {}, 3),  # 32 rows a program
    ("mxfp8", (96, 256), {}, 1),
    ("mxfp8", (2, 48, 64), {}, 1),
    ("nvfp4", (3, 32, 64), {"global_amax": "expert"}, 3),
    ("nvfp4", (2, 8, 2048), {"global_amax": "tensor"}, 2),  # 4 rows a program
    ("nvfp4", (2, 3, 10240), {"global_amax": "expert"}, 2),  # two passes, a row a program
    ("nvfp4", (48, 96), {"global_amax": "row"}, 1),
]


def _master(shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    w = torch.randn(shape, generator=g) * torch.rand((*shape[:-1], 1), generator=g) * 4
    return w.to(dtype)


def _options(w, options):
    opts = dict(options)
    how = opts.get("global_amax")
    if how == "expert":
        opts["global_amax"] = w.float().abs().amax(dim=(1, 2), keepdim=True)
    elif how == "row":
        opts["global_amax"] = w.float().abs().amax(dim=-1, keepdim=True)
    elif how == "tensor":
        opts["global_amax"] = w.float().abs().amax()
    return opts


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "shape", "options", "groups"), CASES)
def test_the_bytes_are_quantize_and_the_parts_the_definition(fmt, shape, options, groups, dtype):
    w = _master(shape, dtype)
    opts = _options(w, options)
    q, parts = quantize_measured(w, fmt, backend=Backend.TRITON, **opts)
    plain = quantize(w, fmt, backend=Backend.TRITON, **opts)
    for got, want in zip(_bytes(q), _bytes(plain), strict=True):
        assert torch.equal(got, want)
    assert parts.dtype == torch.float32 and parts.dim() == 3 and parts.shape[-1] == 3
    assert parts.shape[0] == groups
    assert torch.equal(parts[..., 2], torch.zeros_like(parts[..., 2]))  # no non-finite x
    total = parts[..., :2].reshape(-1, 2).sum(0, dtype=torch.float64)
    torch.testing.assert_close(total, _definition(q, w), rtol=2e-6, atol=0.0)
    assert total[1] > 0  # something was lost: the noise term is not empty
    if groups > 1:  # each group is its expert's
        for e in range(groups):
            sub = quantize(w[e], fmt, backend=Backend.REFERENCE, **_expert_options(opts, e))
            torch.testing.assert_close(
                parts[e, :, :2].sum(0, dtype=torch.float64),
                _definition(sub, w[e]),
                rtol=2e-6,
                atol=0.0,
            )


def _expert_options(opts, e):
    g = opts.get("global_amax")
    if g is None or g.dim() == 0:
        return opts
    return {**opts, "global_amax": g[e]}


@interpreter
@pytest.mark.parametrize(("fmt", "shape", "options", "groups"), CASES)
def test_the_third_column_counts_the_non_finite_elements(fmt, shape, options, groups):
    """A NaN, a +Inf and a -Inf put in the last expert (or row block) of the master: the parts
    count exactly 3 of them, in the parts that hold those elements (the export's NaN/Inf check
    reads these counts instead of the codes); the bytes are still `quantize`'s."""
    w = _master(shape)
    opts = _options(w, options)  # the global amaxes of the finite master (a caller's)
    flat = w.view(-1, shape[-1])
    flat[-1, 0], flat[-1, -1], flat[-2, 1] = float("nan"), float("inf"), float("-inf")
    q, parts = quantize_measured(w, fmt, backend=Backend.TRITON, **opts)
    plain = quantize(w, fmt, backend=Backend.TRITON, **opts)
    for got, want in zip(_bytes(q), _bytes(plain), strict=True):
        assert torch.equal(got, want)
    counts = parts[..., 2]
    assert counts.sum().item() == 3.0 and counts[-1].sum().item() == 3.0
    if groups > 1:
        assert counts[:-1].sum().item() == 0.0


def test_the_reference_measures_nothing():
    """The reference quantizer reads x once for its codes: no parts, the caller's error_sums."""
    w = _master((2, 32, 64))
    q, parts = quantize_measured(w, "mxfp8", backend=Backend.REFERENCE)
    assert parts is None
    assert all(
        torch.equal(a, b) for a, b in zip(_bytes(q), _bytes(quantize(w, "mxfp8")), strict=True)
    )


@interpreter
def test_variants_the_kernels_do_not_measure():
    """MXFP8 along dim -2 and NVFP4 per token or with its own amax pass: the same bytes, no
    parts (the caller measures them)."""
    w = _master((64, 64))
    for fmt, opts in (("mxfp8", {"axis": 0}), ("nvfp4", {"per_token": True}), ("nvfp4", {})):
        q, parts = quantize_measured(w, fmt, backend=Backend.TRITON, **opts)
        assert parts is None
        plain = quantize(w, fmt, backend=Backend.TRITON, **opts)
        assert all(torch.equal(a, b) for a, b in zip(_bytes(q), _bytes(plain), strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "shape", "options", "groups"), CASES)
def test_compiled_bytes_and_parts(fmt, shape, options, groups):
    """Compiled on a GPU (the export's path): the bytes of the kernels without the sums, and
    the parts against the definition."""
    w = _master(shape).cuda()
    opts = _options(w, options)
    q, parts = quantize_measured(w, fmt, **opts)
    plain = quantize(w, fmt, **opts)
    for got, want in zip(_bytes(q), _bytes(plain), strict=True):
        assert torch.equal(got, want)
    assert parts.shape[0] == groups and not parts[..., 2].any()
    total = parts[..., :2].reshape(-1, 2).sum(0, dtype=torch.float64).cpu()
    torch.testing.assert_close(total, _definition(q, w).cpu(), rtol=2e-6, atol=0.0)
