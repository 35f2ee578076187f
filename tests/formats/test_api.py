"""Bad input gets a clear error that names the thing and the fix."""

from __future__ import annotations

import re

import pytest
import torch

from mxrl.formats import dequantize, quantize

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)


@pytest.mark.parametrize(
    ("fmt", "shape", "kwargs", "pattern"),
    [
        ("mxfp8", (4, 48), {}, r"\(4, 48\).*multiple of 32"),
        ("mxfp8", (40, 64), {"axis": 0}, r"dimension 0.*\(40, 64\).*multiple of 32"),
        ("nvfp4", (4, 24), {}, r"\(4, 24\).*K=24.*multiple of 16"),
        ("fp8_block", (4, 192), {}, r"\(128, 128\).*multiple of 128.*\(4, 192\)"),
        ("fp8_block", (256,), {}, r"2-D"),
        ("fp8_block", (4, 128), {"block": (64, 128)}, r"\(1, b\) or \(b, b\)"),
        ("mxfp8", (4, 64), {"per_token": True}, r"nvfp4 options"),
        ("nvfp4", (4, 64), {"axis": 0}, r"only mxfp8"),
        ("mxfp8", (4, 64), {"block": (1, 32)}, r"fp8_block option"),
        ("nvfp4", (4, 64), {"per_token": True, "global_amax": 1.0}, r"one or the other"),
        ("nvfp4", (4, 64), {"global_amax": float("nan")}, r"global_amax"),
        ("nvfp4", (4, 64), {"global_amax": torch.ones(4)}, r"does not fit"),
        ("mxfp8", (4, 64), {"scale_mode": "ceil"}, r"rceil"),
        ("int4", (4, 64), {}, r"unknown format 'int4'"),
        ("bf16", (4, 64), {}, r"not a quantized format"),
        ("mxfp8", (), {}, r"at least one dimension"),
        ("mxfp8", (4, 64), {"axis": 2}, r"out of range"),
    ],
)
def test_bad_arguments_raise_value_error(fmt, shape, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        quantize(torch.ones(shape), fmt, **kwargs)


EMPTY = r"shape \(%s\), with a zero-size dimension: there is nothing to quantize. Skip the call"


@pytest.mark.parametrize(
    ("fmt", "shape", "kwargs"),
    [
        ("mxfp8", (0, 64), {}),
        ("mxfp8", (0, 64), {"axis": 0}),
        ("mxfp8", (4, 0), {}),
        ("nvfp4", (0, 64), {}),
        ("nvfp4", (0, 64), {"per_token": True}),
        ("nvfp4", (4, 0), {"per_token": True}),
        ("nvfp4", (2, 0, 64), {"global_amax": 1.0}),
        ("fp8_block", (0, 128), {}),
        ("fp8_block", (4, 0), {"block": (1, 128)}),
        ("fp8_block", (0,), {"block": (1, 128)}),
    ],
)
def test_zero_size_tensor_is_refused(fmt, shape, kwargs):
    """Before: empty outputs for some, RuntimeError / IndexError / ZeroDivisionError for others.
    Nothing in mxrl quantizes an empty tensor on purpose (an expert with no tokens is skipped)."""
    dims = ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "")
    with pytest.raises(ValueError, match=EMPTY % dims):
        quantize(torch.ones(shape), fmt, **kwargs)


@pytest.mark.parametrize(
    "block", [(128,), (1, 128, 1), "128", 128, (1.0, 128), (True, 128), (0, 128), (1, -128)]
)
def test_malformed_block_is_refused(block):
    """Before: "not enough values to unpack", or (1.0, 128) accepted."""
    with pytest.raises(
        ValueError, match=r"block must be a pair of positive ints.*block=\(128, 128\)"
    ):
        quantize(torch.ones(4, 128), "fp8_block", block=block)


def test_bad_dtype_raises_type_error():
    with pytest.raises(TypeError, match="int64"):
        quantize(torch.ones(4, 32, dtype=torch.int64), "mxfp8")


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8_block"])
def test_check_finite_names_count_and_first_index(fmt):
    x = torch.ones(3, 256)
    x[1, 17] = float("nan")
    x[2, 5] = float("inf")
    x[2, 9] = float("-inf")
    with pytest.raises(ValueError, match=re.escape("3 non-finite value(s)")) as err:
        quantize(x, fmt, check_finite=True)
    assert "(1, 17)" in str(err.value)
    # without the check: no error; NaN/Inf come out NaN (tests/formats/test_non_finite.py)
    q = quantize(x, fmt)
    assert not torch.isfinite(dequantize(q)[~torch.isfinite(x)]).any()


def test_inputs_are_not_modified():
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    before = x.clone()
    for fmt in ("mxfp8", "nvfp4"):
        quantize(x, fmt)
    assert torch.equal(x.view(torch.int16), before.view(torch.int16))
