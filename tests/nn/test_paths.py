"""The GEMM paths as strategy objects (mxrl/nn/paths/__init__.py, docs/design.md §4.5): one path
per `Gemm`, and a QLinear's GEMM run through the path of its choice gives, byte for byte, what
that path's autograd Function gives called directly (forward and both gradients)."""

from __future__ import annotations

import pytest
import torch

from mxrl.kernels import Backend, Gemm
from mxrl.nn import QLinear
from mxrl.nn.paths import PATHS, GemmPath, ReferencePath, TensorCorePath, path_for
from mxrl.nn.paths.reference import QMatmul
from mxrl.nn.paths.tensor_core import TensorCoreQMatmul
from mxrl.recipe import Backward
from tests.nn.test_qmatmul import spec
from tests.numerics import assert_bytes_equal


def test_every_gemm_has_its_path():
    assert set(PATHS) == set(Gemm)
    for gemm in Gemm:
        path: GemmPath = path_for(gemm)
        assert path.gemm is gemm and path.autograd
        assert path_for(gemm.value) is path  # a name resolves to the same object
    assert isinstance(path_for(Gemm.REFERENCE), ReferencePath)
    assert isinstance(path_for(Gemm.TENSOR_CORE), TensorCorePath)
    with pytest.raises(ValueError):
        path_for("cublas")


def _direct(op, q, gemm, x, s, mode):
    """op.apply on the layer's cached weight of `gemm`: y, dx, dw for a gradient of ones."""
    x = x.detach().requires_grad_()
    q.weight.grad = None
    y = op.apply(x, q.weight, q.qweight(gemm), s, Backward(mode), Backend.REFERENCE)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad, q.weight.grad.clone()


@pytest.mark.parametrize("fmt,mode", [("mxfp8", "high_precision"), ("nvfp4", "dequantized")])
def test_a_qlinear_runs_the_function_of_its_path(fmt, mode):
    """On these formats and modes the two Functions give different bytes on the CPU (bf16
    operands against fp32), so the layer's bytes tell which one ran."""
    s = spec(fmt, shape=(32, 64))
    torch.manual_seed(0)
    q = QLinear(64, 32, False, s, mode)
    x = torch.randn(5, 64)
    ops = {Gemm.REFERENCE: QMatmul, Gemm.TENSOR_CORE: TensorCoreQMatmul}
    direct = {gemm: _direct(op, q, gemm, x, s, mode) for gemm, op in ops.items()}
    assert not all(map(torch.equal, *direct.values()))
    for gemm in ops:
        q.gemm_choice = gemm
        xg = x.clone().requires_grad_()
        q.weight.grad = None
        y = q(xg)
        y.backward(torch.ones_like(y))
        got = (y.detach(), xg.grad, q.weight.grad)
        for name, a, b in zip(("y", "dx", "dw"), got, direct[gemm], strict=True):
            assert_bytes_equal(a, b, f"{gemm} {name}")
