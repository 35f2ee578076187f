"""The quantized backward on the triton backend, bit for bit against the reference backend: under
Triton's CPU interpreter (TRITON_INTERPRET=1, set up as in tests/kernels/conftest.py; skipped
where triton is not importable or CUDA is present) and compiled on CUDA (`pytest -m gpu`).

The backend only changes who quantizes dy and x in the backward, never the bytes, so the
gradients match exactly. A spy on the triton op checks that the backward really ran it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mxrl.kernels import Backend
from mxrl.nn import QLinear, set_gemm
from mxrl.recipe import TensorSpec
from tests.kernels import conftest as kernels_conftest
from tests.numerics import assert_bytes_equal

K, N = 64, 32  # the interpreter is slow: one 32-column block of dy, two of x


def under_interpreter(test):
    """The interpreter tier's marks: `triton`, skipped where CUDA is present or the interpreter
    could not be switched on, NumPy's IEEE warnings ignored."""
    for mark in (
        pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.*"),
        pytest.mark.skipif(
            not kernels_conftest.INTERPRETER_READY,
            reason="interpreter tests run without CUDA, with TRITON_INTERPRET=1 set before "
            "triton is imported (pytest tests/nn, or TRITON_INTERPRET=1 pytest)",
        ),
        pytest.mark.triton,
    ):
        test = mark(test)
    return test


def _qlinear(backend: Backend, device: str) -> QLinear:
    spec = TensorSpec(
        name="model.layers.0.mlp.down_proj.weight",
        shape=(N, K),
        kind="dense_mlp",
        layer=0,
        expert=None,
        role="down",
        format="mxfp8",
    )
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
    return QLinear.from_linear(lin.to(device), spec, "quantized", backend=backend)


def _grads(backend: Backend, device: str, rows: int, dtype: torch.dtype, calls: list):
    """y, dx, dw; `calls` (the spy's record) holds the activations' calls of one forward and
    backward (a first forward quantizes and caches the weight, then the record is cleared)."""
    q = _qlinear(backend, device)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=g).to(device, dtype).requires_grad_(True)
    dy = torch.randn(rows, N, generator=g).to(device, dtype)
    with torch.no_grad():
        q(x)
    calls.clear()
    y = q(x)
    y.backward(dy)
    return y.detach(), x.grad, q.weight.grad


def _spy_on_triton_mxfp8(monkeypatch) -> list[tuple[tuple[int, ...], bool, bool]]:
    """Record (shape, rowwise, colwise) of each call of the triton mxfp8 ops: the quantizer, and
    its one-pass quantize -> bf16 values (`qdq_mxfp8`, which the tensor-core path calls where no
    codes are kept). Both are what the api calls in eager mode (`ops.EAGER`)."""
    from mxrl.kernels import ops

    calls = []
    for name in ("quantize_mxfp8", "qdq_mxfp8"):
        original = ops.EAGER[name]

        def spy(x, rowwise, colwise, original=original):
            calls.append((tuple(x.shape), rowwise, colwise))
            return original(x, rowwise, colwise)

        monkeypatch.setitem(ops.EAGER, name, spy)
    return calls


def _check_backends_agree(monkeypatch, device: str, rows: int, dtype: torch.dtype) -> None:
    ref = _grads(Backend.REFERENCE, device, rows, dtype, [])
    calls = _spy_on_triton_mxfp8(monkeypatch)
    tri = _grads(Backend.TRITON, device, rows, dtype, calls)
    for name, got, want in zip(("y", "dx", "dw"), tri, ref, strict=True):
        assert_bytes_equal(got, want, name)
    padded = -(-rows // 32) * 32  # tokens zero-padded to whole 32-row blocks
    # forward: x row-wise; dy: both copies in one read; x: the column-wise copy (quantized in
    # the backward by qmatmul, in the forward by the tensor-core path on CUDA: same bytes)
    want = [((rows, K), True, False), ((padded, N), True, True), ((padded, K), False, True)]
    if device == "cuda":  # tensor cores: the weight's column-wise copy, made by the backward
        want.append(((N, K), False, True))
    assert sorted(calls) == sorted(want), calls


@under_interpreter
@pytest.mark.parametrize(("rows", "dtype"), [(33, torch.float32), (40, torch.bfloat16)])
def test_quantized_backward_triton_equals_reference_under_interpreter(monkeypatch, rows, dtype):
    _check_backends_agree(monkeypatch, "cpu", rows, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [32, 33, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_backward_triton_equals_reference_on_cuda(monkeypatch, rows, dtype):
    _check_backends_agree(monkeypatch, "cuda", rows, dtype)


# --- the tensor-core path: the triton backend also writes the bf16 operands ---------------------
def _tensor_core_grads(fmt: str, mode: str, backend: Backend, calls: list):
    """y, dx, dw of the tensor-core dense op and of the grouped experts' two projections."""
    from tests.nn import test_qmatmul as tq
    from tests.nn.test_fast import _module

    lin = tq.make_linear(fmt, mode)
    q = QLinear.from_linear(nn.Linear(tq.K, tq.N, bias=False), lin.spec, mode, backend=backend)
    q.weight = lin.weight
    set_gemm(q, "tensor_core")
    x, dy = tq.inputs()
    x = x.clone().requires_grad_(True)
    with torch.no_grad():
        q(x)  # quantizes and caches the weight
    calls.clear()
    y = q(x)
    y.backward(dy.to(torch.bfloat16).float())
    out = [y.detach(), x.grad, q.weight.grad]
    experts, module = _module(fmt, mode, backend=backend.value)
    set_gemm(module, "tensor_core")
    g = torch.Generator().manual_seed(9)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(21)])
    h = torch.randn(21, experts.hidden_size, generator=g).requires_grad_(True)
    weights = torch.rand(21, 2, generator=g)
    o = module(h, ids, weights)
    o.backward(torch.randn(o.shape, generator=g).to(o.dtype))
    return [*out, o.detach(), h.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


# the triton ops each case's experts must run (in eager mode, `ops.EAGER`): MXFP8's quantized
# backward its padded copies, the high-precision one its QDQ, the rest the quantizers
RUNS = {
    ("mxfp8", "quantized"): {"quantize_mxfp8_padded", "qdq_mxfp8"},
    ("mxfp8", "high_precision"): {"qdq_mxfp8"},
    ("mxfp8", "dequantized"): {"quantize_mxfp8"},
    ("nvfp4", "dequantized"): {"quantize_nvfp4", "scale_bf16"},
}


@under_interpreter
@pytest.mark.parametrize(("fmt", "mode"), list(RUNS))
def test_tensor_core_path_triton_equals_reference_under_interpreter(monkeypatch, fmt, mode):
    """Forward and every gradient of the tensor-core dense op and grouped experts are the same
    bits whether the reference or the triton kernels quantize and write the bf16 operands
    (`mxrl.kernels.dequantize`); a spy checks the dequantize op ran."""
    from mxrl.kernels import ops

    want = _tensor_core_grads(fmt, mode, Backend.REFERENCE, [])
    calls: list = []
    original = ops.EAGER["dequantize_bf16"]  # what the api calls in eager mode

    def spy(*args):
        calls.append(args[3])
        return original(*args)

    monkeypatch.setitem(ops.EAGER, "dequantize_bf16", spy)
    ran: list[str] = []  # the other ops the triton backend ran
    for name in ("scale_bf16", "quantize_mxfp8_padded", "qdq_mxfp8", "quantize_mxfp8",
                 "quantize_nvfp4"):  # fmt: skip
        op = ops.EAGER[name]
        monkeypatch.setitem(ops.EAGER, name, lambda *a, n=name, op=op: ran.append(n) or op(*a))
    got = _tensor_core_grads(fmt, mode, Backend.TRITON, calls)
    names = ("y", "dx", "dw", "experts out", "experts dx", "gate_up dw", "down dw")
    for name, a, b in zip(names, got, want, strict=True):
        assert_bytes_equal(a, b, f"{fmt} {mode} {name}")
    assert calls or mode == "high_precision", "the triton backend did not run the dequantize"
    assert RUNS[(fmt, mode)] <= set(ran), ran
    # NVFP4's global scales on each grouped projection's bf16 output (gate_up, down)
    assert ran.count("scale_bf16") == (2 if fmt == "nvfp4" else 0), ran
