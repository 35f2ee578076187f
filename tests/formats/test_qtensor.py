"""QTensor fields, validation, and the safetensors round trip (bit-identical)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxrl.formats import QTensor, dequantize, quantize
from tests import cases
from tests.numerics import assert_bytes_equal, assert_qtensor_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

VARIANTS = [
    ("mxfp8", {}, (64, 96)),
    ("mxfp8", {"axis": 0}, (64, 96)),
    ("mxfp8", {"axis": 1}, (3, 64, 96)),
    ("mxfp8", {"scale_mode": "floor"}, (2, 5, 64)),
    ("nvfp4", {}, (64, 96)),
    ("nvfp4", {"per_token": True}, (2, 5, 64)),
    ("nvfp4", {"global_amax": 7.5}, (3, 32, 48)),
    ("fp8_block", {}, (130, 256)),
    ("fp8_block", {"block": (1, 128)}, (4, 3, 128)),
    ("fp8_block", {}, (2, 130, 128)),
]
IDS = [f"{f}-{k}-{'x'.join(map(str, s))}" for f, k, s in VARIANTS]


@pytest.mark.parametrize(("fmt", "kwargs", "shape"), VARIANTS, ids=IDS)
def test_fields(fmt, kwargs, shape):
    x = cases.randn(shape, torch.bfloat16, seed=3)
    q = quantize(x, fmt, **kwargs)
    assert q.qdata.dtype == torch.uint8 and q.shape == x.shape and q.fmt == fmt
    want_scale = {
        "mxfp8": torch.float8_e8m0fnu,
        "nvfp4": torch.float8_e4m3fn,
        "fp8_block": torch.float32,
    }[fmt]
    assert q.scale.dtype == want_scale
    if fmt == "nvfp4":
        assert q.qdata.shape == (*shape[:-1], shape[-1] // 2)
        assert q.global_scale.dtype == torch.float32
        assert q.global_scale.shape == ((*shape[:-1], 1) if kwargs.get("per_token") else ())
    else:
        assert q.qdata.shape == shape and q.global_scale is None
    assert dequantize(q).shape == shape and dequantize(q).dtype == torch.float32


@pytest.mark.parametrize(("fmt", "kwargs", "shape"), VARIANTS, ids=IDS)
def test_safetensors_round_trip_is_bit_identical(tmp_path, fmt, kwargs, shape):
    x = cases.randn(shape, torch.float32, seed=4)
    q = quantize(x, fmt, **kwargs)
    path = tmp_path / "q.safetensors"
    save_file(q.to_state_dict("model.layers.0.mlp.w"), str(path))
    back = QTensor.from_state_dict(load_file(str(path)), "model.layers.0.mlp.w")
    assert_qtensor_bytes_equal(back, q, "round trip")
    assert back.block == q.block and back.per_token == q.per_token
    assert_bytes_equal(dequantize(back), dequantize(q), "dequantized")


def test_from_state_dict_names_missing_prefix():
    with pytest.raises(KeyError, match=r"model\.x"):
        QTensor.from_state_dict({}, "model.x")


def test_validation_names_the_problem():
    q = quantize(torch.randn(4, 32), "nvfp4")
    with pytest.raises(TypeError, match="uint8"):
        QTensor(q.qdata.float(), q.scale, "nvfp4", q.shape, global_scale=q.global_scale)
    with pytest.raises(ValueError, match="qdata of shape"):
        QTensor(q.qdata[:, :3], q.scale, "nvfp4", q.shape, global_scale=q.global_scale)
    with pytest.raises(ValueError, match="global_scale is required"):
        QTensor(q.qdata, q.scale, "nvfp4", q.shape)
    with pytest.raises(TypeError, match="scale must be"):
        QTensor(q.qdata, q.scale.view(torch.uint8), "nvfp4", q.shape, global_scale=q.global_scale)


def test_nbytes_counts_data_and_scales():
    q = quantize(torch.randn(128, 256), "nvfp4", per_token=True)
    assert q.nbytes == 128 * 128 + 128 * 16 + 128 * 4
    assert quantize(torch.randn(128, 256), "mxfp8").nbytes == 128 * 256 + 128 * 8
