"""Shared numerics helpers for tests: byte-exact comparison on uint8 views, SQNR, hashes.

Byte-exact means bytes: every comparison here views both tensors as uint8 (after making them
contiguous on CPU), so -0.0 vs 0.0, NaN payloads and scale padding all count.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mxrl.formats import QTensor, sqnr_db, tensor_hash
from mxrl.formats.numerics import tensor_bytes

__all__ = [
    "as_bytes",
    "assert_bytes_equal",
    "assert_qtensor_bytes_equal",
    "sqnr_db",
    "tensor_bytes",
    "tensor_hash",
]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Contiguous CPU uint8 view of any tensor (a 0-d tensor becomes 1-d)."""
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8)


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Shapes, dtypes and every byte equal; on failure say how many bytes differ and where."""
    label = f"{what}: " if what else ""
    assert actual.dtype == expected.dtype, f"{label}dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{label}shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    a, e = as_bytes(actual), as_bytes(expected)
    diff = (a != e).nonzero().reshape(-1)
    if diff.numel():
        i = int(diff[0])
        elem = i // max(actual.element_size(), 1)
        raise AssertionError(
            f"{label}{diff.numel()} of {a.numel()} bytes differ; first at byte {i} "
            f"(element {elem}): got 0x{int(a[i]):02x}, want 0x{int(e[i]):02x}"
        )


def assert_same_outputs(want, got, what: str = "") -> None:
    """Two lists of engine outputs, request by request: the same tokens, and logprobs and
    routed experts byte for byte."""
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert a.tokens == b.tokens, f"{what} request {i}"
        assert_bytes_equal(a.logprobs, b.logprobs, f"{what} request {i} logprobs")
        assert_bytes_equal(a.routed_experts, b.routed_experts, f"{what} request {i} routing")


def assert_qtensor_bytes_equal(actual: QTensor, expected: QTensor, what: str = "") -> None:
    """Every stored field of two QTensors, byte for byte, plus format, shape and axis."""
    assert actual.fmt == expected.fmt, f"{what}: fmt {actual.fmt} != {expected.fmt}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.axis == expected.axis, f"{what}: axis {actual.axis} != {expected.axis}"
    fa, fe = actual.tensors(), expected.tensors()
    assert fa.keys() == fe.keys(), f"{what}: fields {sorted(fa)} != {sorted(fe)}"
    for name in fa:
        assert_bytes_equal(fa[name], fe[name], f"{what} {name}".strip())


class HostReads(TorchDispatchMode):
    """The ops that read a tensor's value back to the host (`bool(t)`, `t.item()`, `.tolist()`;
    on a GPU each is a sync), in call order: `with HostReads() as reads: ...; reads.ops`."""

    _READS = (
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.is_nonzero.default,
        torch.ops.aten.item.default,
    )

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self._READS:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def assert_e4m3_equal_but_top(
    actual: torch.Tensor, oracle: torch.Tensor, top: torch.Tensor, what: str = ""
) -> None:
    """E4M3 element bytes equal to an oracle that follows the plain satfinite rule (torchao,
    TransformerEngine, DeepGEMM), but for the one documented departure (docs/formats.md, "The
    top of the fp32 range"): where the element's scale is 2^120 (`top`, a bool mask of the
    elements' shape) and the oracle stores ±256 (0x78 / 0xF8), whose dequantized value is
    ±2^128 = ±Inf, mxrl stores ±240 (0x77 / 0xF7). Every other byte is equal."""
    oracle = oracle.to("cpu").reshape(actual.shape)
    top = top.to("cpu").reshape(actual.shape)
    overflowing = top & ((oracle & 0x7F) == 0x78)
    assert_bytes_equal(actual, torch.where(overflowing, oracle - 1, oracle), what)
