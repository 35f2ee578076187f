"""Backend selection rules (house style 5) and the reference dispatch; no triton needed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mxrl import kernels
from mxrl.formats import quantize as reference_quantize
from mxrl.kernels import Backend, Gemm, Kernels, default_kernels, select_backend
from mxrl.kernels import backend as backend_mod
from mxrl.kernels.backend import backend_for
from tests import cases
from tests.numerics import assert_qtensor_bytes_equal


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_backend_values():
    assert [b.value for b in Backend] == ["reference", "triton"]
    assert Backend("triton") is Backend.TRITON


def test_cpu_default_is_reference(monkeypatch):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    assert select_backend(device="cpu") is Backend.REFERENCE
    assert select_backend(None, torch.device("cpu")) is Backend.REFERENCE


def test_cuda_default_is_triton_when_importable(monkeypatch):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_backend(device="cuda") is Backend.TRITON
    monkeypatch.setattr(backend_mod, "triton_available", lambda: False)
    assert select_backend(device="cuda") is Backend.REFERENCE


def test_default_device_follows_cuda_availability(monkeypatch):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_backend() is Backend.REFERENCE


def test_reference_always_allowed(monkeypatch):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: False)
    assert select_backend("reference", "cpu") is Backend.REFERENCE
    assert select_backend(Backend.REFERENCE, "cuda") is Backend.REFERENCE


def test_triton_without_triton_names_the_package(monkeypatch):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="triton package"):
        select_backend("triton", "cuda")


def test_triton_on_cpu_names_cuda(monkeypatch, no_interpreter):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("triton", "cpu")


def test_triton_on_cuda_without_cuda(monkeypatch):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device"):
        select_backend("triton", "cuda")


def test_triton_on_cpu_allowed_under_interpreter(monkeypatch):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("triton", "cpu") is Backend.TRITON


def test_unknown_backend():
    with pytest.raises(ValueError, match="'reference', 'triton'"):
        select_backend("cutlass")


def test_quantize_on_cpu_is_the_reference():
    x = cases.randn((64, 128), torch.bfloat16, seed=1)
    for fmt, kw in (("mxfp8", {}), ("nvfp4", {"per_token": True}), ("fp8_block", {})):
        got = kernels.quantize(x, fmt, **kw)
        assert_qtensor_bytes_equal(got, reference_quantize(x, fmt, **kw), fmt)
    row, col = kernels.quantize_mxfp8_both(x)
    assert_qtensor_bytes_equal(row, reference_quantize(x, "mxfp8"), "row")
    assert_qtensor_bytes_equal(col, reference_quantize(x, "mxfp8", axis=0), "col")


def test_reference_backend_keeps_comparison_modes():
    x = cases.randn((32, 64), torch.float32, seed=2)
    got = kernels.quantize(x, "mxfp8", scale_mode="floor", backend="reference")
    assert_qtensor_bytes_equal(got, reference_quantize(x, "mxfp8", scale_mode="floor"))


@pytest.mark.parametrize(
    ("fmt", "kwargs", "match"),
    [
        ("mxfp8", {"scale_mode": "floor"}, "use backend 'reference'"),
        ("nvfp4", {"scale_mode": "torchao"}, "use backend 'reference'"),
        ("fp8_block", {"block": (1, 96)}, "other block sizes"),
        ("mxfp8", {"axis": 0}, "block along the last dim or dim -2"),
    ],
)
def test_triton_rejects_comparison_modes_before_any_kernel(monkeypatch, fmt, kwargs, match):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros((32, 32, 192), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        kernels.quantize(x, fmt, backend="triton", **kwargs)


def test_triton_backend_validates_like_the_reference(monkeypatch):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="not a multiple of 32"):
        kernels.quantize(torch.zeros(4, 48), "mxfp8", backend="triton")
    with pytest.raises(ValueError, match="not a multiple of 16"):
        kernels.quantize(torch.zeros(4, 40), "nvfp4", backend="triton")
    with pytest.raises(ValueError, match="does not fit"):
        kernels.quantize(torch.ones(4, 32), "nvfp4", global_amax=torch.ones(3, 1), backend="triton")
    with pytest.raises(ValueError, match="non-finite"):
        bad = torch.tensor([[float("nan")] * 32])
        kernels.quantize(bad, "mxfp8", check_finite=True, backend="triton")
    with pytest.raises(ValueError, match=r"\[\.\.\., M, K\]"):
        kernels.quantize_mxfp8_both(torch.zeros(64), backend="triton")
    for fmt, kw in (("mxfp8", {}), ("nvfp4", {"per_token": True}), ("fp8_block", {})):
        with pytest.raises(ValueError, match="zero-size dimension: there is nothing to quantize"):
            kernels.quantize(torch.zeros(0, 128), fmt, backend="triton", **kw)
    with pytest.raises(ValueError, match="nothing to quantize"):
        kernels.quantize_mxfp8_both(torch.zeros(0, 64), backend="triton")
    for block in ((128,), (1.0, 128), (0, 128)):
        with pytest.raises(ValueError, match="block must be a pair of positive ints"):
            kernels.quantize(torch.zeros(4, 128), "fp8_block", block=block, backend="triton")
    with pytest.raises(ValueError, match=r"finite and non-negative.*inf"):
        amax = torch.tensor(float("inf"))
        kernels.quantize(torch.ones(4, 32), "nvfp4", global_amax=amax, backend="triton")
    with pytest.raises(ValueError, match=r"global_amax 1 at index \(\) is below the amax"):
        x = torch.full((4, 32), 2.0)  # checked against x before any kernel runs
        kernels.quantize(x, "nvfp4", global_amax=1.0, backend="triton")


def test_importing_kernels_does_not_import_triton():
    code = "import sys, mxrl.kernels, mxrl.kernels.api; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the Kernels record (design.md §4.4): the CUDA choices checked without a GPU, the device's
# capability passed to the resolver


@pytest.fixture
def cuda_with_triton(monkeypatch, no_interpreter):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_kernels_cuda_default_is_triton_and_tensor_cores(cuda_with_triton):
    k = Kernels.resolve(None, "cuda:0", capability=(9, 0))
    assert k.device == torch.device("cuda:0")
    assert k.train_gemm is Gemm.TENSOR_CORE
    for field in ("quantizer", "rollout_gemm", "attention", "rowwise", "sampler"):
        assert getattr(k, field) is Backend.TRITON, field


def test_kernels_cuda_below_sm90_keeps_the_reference_gemm(cuda_with_triton):
    k = Kernels.resolve(None, "cuda:0", capability=(8, 0))
    assert k.train_gemm is Gemm.REFERENCE
    assert k.quantizer is Backend.TRITON
    with pytest.raises(ValueError, match=r"sm_90\+ GPU.*sm_80"):
        Kernels.resolve(None, "cuda:0", "tensor_core", capability=(8, 0))


def test_kernels_cuda_reference_backend(cuda_with_triton):
    k = Kernels.resolve("reference", "cuda:0", capability=(9, 0))
    assert k.train_gemm is Gemm.TENSOR_CORE
    for field in ("quantizer", "rollout_gemm", "attention", "rowwise", "sampler"):
        assert getattr(k, field) is Backend.REFERENCE, field


def test_kernels_cpu_default_is_the_reference(monkeypatch):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    k = Kernels.resolve(None, "cpu")
    assert k == default_kernels(torch.device("cpu"))
    assert k.train_gemm is Gemm.REFERENCE
    for field in ("quantizer", "rollout_gemm", "attention", "rowwise", "sampler"):
        assert getattr(k, field) is Backend.REFERENCE, field
    # the tensor-core algorithm runs on the CPU (slowly: the tests' way to check its logic)
    assert Kernels.resolve(None, "cpu", "tensor_core").train_gemm is Gemm.TENSOR_CORE


def test_kernels_triton_under_the_interpreter_samples_with_torch(monkeypatch):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = Kernels.resolve("triton", "cpu")
    assert k.quantizer is Backend.TRITON and k.rowwise is Backend.TRITON
    assert k.sampler is Backend.REFERENCE  # the one-launch sampler is for CUDA


def test_kernels_refusals_name_the_requirement(monkeypatch, no_interpreter):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Kernels.resolve("triton", "cpu")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        Kernels.resolve("cutlass", "cpu")
    with pytest.raises(ValueError, match="unknown gemm 'fast'"):
        Kernels.resolve(None, "cpu", "fast")
    ref = Backend.REFERENCE
    with pytest.raises(TypeError, match=r"Kernels\.device must be a torch\.device"):
        Kernels("cpu", ref, Gemm.REFERENCE, ref, ref, ref, ref)


def test_a_record_or_a_field_of_it_reaches_the_kernels(monkeypatch):
    x = cases.randn((8, 64), torch.bfloat16, seed=3)
    record = Kernels.resolve("reference", "cpu")
    got = kernels.quantize(x, "mxfp8", backend=record)
    assert_qtensor_bytes_equal(got, reference_quantize(x, "mxfp8"), "mxfp8")
    assert backend_for(record, "cpu", "rollout_gemm") is Backend.REFERENCE
    assert backend_for(None, "cpu") is Backend.REFERENCE
