"""The non-finite policy (docs/formats.md, "Non-finite inputs"), one table for every format.

For each format variant and each of NaN, +Inf, -Inf placed in a tensor:
- the bad element dequantizes to NaN (NVFP4: its whole 16-element block, scale byte 0x7F);
- every other byte equals that of the same tensor with the bad element(s) replaced by 0 (the
  scales, the global scale, the finite neighbours' codes): nothing else moves;
- the bad element's own code is the documented one (E4M3 0x7F; E2M1 NaN/+Inf 0x7, -Inf 0xF);
- check_finite=True refuses, naming the first index and its value.
`check_policy` takes the quantize function, so the Triton interpreter tests run the same table
on the kernels (tests/kernels/test_interpreter.py).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from mxrl.formats import QTensor, codecs, dequantize, quantize
from mxrl.formats import constants as C
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

VALUES = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}
# (name, fmt, quantize kwargs, caller global amax: None, "scalar" or "rows")
CONFIGS = [
    ("mxfp8-row", "mxfp8", {}, None),
    ("mxfp8-col", "mxfp8", {"axis": 0}, None),
    ("nvfp4-tensor", "nvfp4", {}, None),
    ("nvfp4-token", "nvfp4", {"per_token": True}, None),
    ("nvfp4-amax-scalar", "nvfp4", {}, "scalar"),
    ("nvfp4-amax-rows", "nvfp4", {}, "rows"),
    ("nvfp4-4over6-tensor", "nvfp4", {"scale_mode": "4over6"}, None),
    ("nvfp4-4over6-token", "nvfp4", {"per_token": True, "scale_mode": "4over6"}, None),
    ("fp8-1x128", "fp8_block", {"block": (1, 128)}, None),
    ("fp8-1x128-ue8m0", "fp8_block", {"block": (1, 128), "scale_mode": "ue8m0"}, None),
    ("fp8-128x128", "fp8_block", {}, None),
    ("fp8-128x128-ue8m0", "fp8_block", {"scale_mode": "ue8m0"}, None),
]
CONFIG_IDS = [c[0] for c in CONFIGS]
SHAPE = (160, 256)  # 128x128 blocks with a partial last row-block; 32-row multiples
# (37, 70): inside everything; (150, 255): the partial row-block, the last column
INDICES = [(37, 70), (150, 255)]


def finite_amax(x: torch.Tensor, dim=None) -> torch.Tensor:
    xf = x.float()
    mag = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf))
    return mag.amax() if dim is None else mag.amax(dim=dim, keepdim=True)


def call_kwargs(config, x: torch.Tensor) -> dict:
    _, _, kwargs, amax = config
    kwargs = dict(kwargs)
    if amax == "scalar":
        kwargs["global_amax"] = finite_amax(x) * 2  # not the tensor's own amax
    elif amax == "rows":
        kwargs["global_amax"] = finite_amax(x, dim=-1)
    return kwargs


def check_policy(quantize_fn, config, x_bad: torch.Tensor) -> QTensor:
    """The policy for x_bad (any NaN/Inf pattern) against x_bad with its bad elements 0;
    returns quantize_fn's QTensor of x_bad."""
    name, fmt = config[0], config[1]
    bad = ~torch.isfinite(x_bad)
    assert bool(bad.any())
    x_zero = torch.where(bad, torch.zeros_like(x_bad), x_bad)
    kwargs = call_kwargs(config, x_bad)
    q = quantize_fn(x_bad, fmt, **kwargs)
    q0 = quantize_fn(x_zero, fmt, **kwargs)
    deq, deq0 = dequantize(q), dequantize(q0)

    if fmt == "nvfp4":
        blocks_bad = bad.reshape(*bad.shape[:-1], -1, C.NVFP4_BLOCK).any(dim=-1)
        nan_block = blocks_bad.repeat_interleave(C.NVFP4_BLOCK, dim=-1)
        scale, scale0 = q.scale.view(torch.uint8), q0.scale.view(torch.uint8)
        assert (scale[blocks_bad] == C.E4M3_NAN_CODE).all(), f"{name}: bad block scale"
        assert_bytes_equal(scale[~blocks_bad], scale0[~blocks_bad], f"{name} other scales")
        assert_bytes_equal(q.global_scale, q0.global_scale, f"{name} global scale")
        codes, codes0 = codecs.unpack_nibbles(q.qdata), codecs.unpack_nibbles(q0.qdata)
        assert_bytes_equal(codes[~bad], codes0[~bad], f"{name} finite codes")
        want = torch.where(x_bad[bad] == -math.inf, 0xF, 0x7).to(torch.uint8)
        assert_bytes_equal(codes[bad], want, f"{name} bad codes (NaN, +Inf 0x7; -Inf 0xF)")
        assert torch.isnan(deq[nan_block]).all(), f"{name}: the bad block dequantizes to NaN"
        assert_bytes_equal(deq[~nan_block], deq0[~nan_block], f"{name} other values")
    else:
        scale = q.scale if q.scale.dtype == torch.float32 else q.scale.view(torch.uint8)
        scale0 = q0.scale if q0.scale.dtype == torch.float32 else q0.scale.view(torch.uint8)
        assert_bytes_equal(scale, scale0, f"{name} scales")
        assert (q.qdata[bad] == C.E4M3_NAN_CODE).all(), f"{name}: bad elements are 0x7F"
        assert_bytes_equal(q.qdata[~bad], q0.qdata[~bad], f"{name} finite elements")
        assert torch.isnan(deq[bad]).all(), f"{name}: bad elements dequantize to NaN"
        assert_bytes_equal(deq[~bad], deq0[~bad], f"{name} other values")
    return q


def make_input(dtype: torch.dtype, index, value: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(SHAPE, generator=g) * 4).to(dtype)
    x[index] = value
    return x


@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_non_finite_element(dtype, config, value):
    for index in INDICES:
        check_policy(quantize, config, make_input(dtype, index, VALUES[value]))


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_block_of_non_finite_elements_and_the_block_amax(config):
    """A 128-element row segment of NaN/Inf (whole MXFP8 / NVFP4 / 1x128 blocks: amax 0), and
    an Inf that would be its block's amax next to a NaN that would not."""
    x = make_input(torch.float32, (0, 0), 1.0)
    x[5, 128:] = torch.tensor([math.nan, math.inf, -math.inf, math.nan]).repeat(32)
    x[9, 40] = 1e30
    x[9, 41] = -math.inf
    x[9, 44] = math.nan
    check_policy(quantize, config, x)


@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_check_finite_refuses_naming_index_and_value(config, value):
    x = make_input(torch.bfloat16, (150, 255), VALUES[value])
    x[151, 3] = math.nan
    first = f"first at index (150, 255) = {VALUES[value]}"  # nan, inf, -inf
    with pytest.raises(ValueError, match=re.escape(f"2 non-finite value(s) (NaN/Inf); {first}")):
        quantize(x, config[1], check_finite=True, **call_kwargs(config, x))


@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0])
def test_caller_global_amax_must_be_finite(value):
    amax = torch.ones(4, 1)
    amax[2, 0] = value
    with pytest.raises(ValueError, match=r"finite and non-negative.*index \(2, 0\)"):
        quantize(torch.ones(4, 64), "nvfp4", global_amax=amax)


def test_dequantize_of_nan_codes_and_scales_is_nan():
    """E4M3 0x7F, E8M0 0xFF and an NVFP4 block scale 0x7F dequantize to NaN (bytes from
    outside, e.g. a checkpoint: quantize itself never writes an E8M0 NaN)."""
    q = quantize(torch.ones(2, 32), "mxfp8")
    q.qdata[0, 3] = C.E4M3_NAN_CODE
    q.scale.view(torch.uint8)[1, 0] = C.E8M0_NAN_CODE
    deq = dequantize(q)
    assert torch.isnan(deq[0, 3]) and torch.isfinite(deq[0, :3]).all()
    assert torch.isnan(deq[1]).all()
    q4 = quantize(torch.ones(2, 32), "nvfp4")
    q4.scale.view(torch.uint8)[0, 1] = C.E4M3_NAN_CODE
    for deq4 in (dequantize(q4), dequantize(q4, global_scale=False)):
        assert torch.isnan(deq4[0, 16:]).all() and torch.isfinite(deq4[0, :16]).all()
        assert torch.isfinite(deq4[1]).all()
