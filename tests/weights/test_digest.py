"""The device-side checksum: every stored byte, its position, dtype and shape count; the GEMM and
the elementwise path give the same integers; CPU and CUDA (the Triton kernel, and the reference
there) give the same checksum. The kernel under Triton's interpreter is tested in
tests/kernels/test_digest_kernel.py."""

import importlib
import importlib.util

import pytest
import torch

from mxrl.formats import QTensor, quantize
from mxrl.recipe import resolve
from mxrl.weights import checksum, checksums, export_weights
from tests.engine.test_engine import tiny as engine_tiny
from tests.sync.helpers import tiny

digest = importlib.import_module("mxrl.weights.digest")  # the module (mxrl.weights.checksum is
# the function)

ROW = digest.ROW_BYTES


def random_bytes(n: int, seed: int = 0, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def flipped(t: torch.Tensor, index: int, bit: int = 0) -> torch.Tensor:
    out = t.clone()
    out.reshape(-1).view(torch.uint8)[index] ^= 1 << bit
    return out


SIZES = [1, 7, ROW - 1, ROW, ROW + 1, 17 * ROW + 5, 40 * ROW * 32 + 3]  # the last: 3 levels


@pytest.mark.parametrize("n", SIZES)
def test_any_flipped_bit_changes_the_checksum(n):
    x = random_bytes(n)
    base = checksum(x)
    assert checksum(x.clone()) == base
    positions = {0, n // 2, n - 1, max(0, n - ROW // 2)}
    for i in positions:
        for bit in (0, 7):
            assert checksum(flipped(x, i, bit)) != base, (i, bit)


def test_reordered_rows_bytes_and_experts_change_it():
    x = random_bytes(8 * ROW).view(8, ROW)
    base = checksum(x)
    assert checksum(x[[1, 0, *range(2, 8)]].contiguous()) != base  # two whole rows swapped
    y = x.clone()
    y[3, 10], y[3, 11] = x[3, 11].clone(), x[3, 10].clone()
    assert torch.equal(x, y) or checksum(y) != base  # two bytes swapped (if they differ)
    experts = torch.randn(4, 16, 64)
    assert checksum(experts.flip(0).contiguous()) != checksum(experts)


def test_dtype_shape_and_length_are_bound():
    x = torch.randn(64, 32)
    base = checksum(x)
    assert checksum(x.view(32, 64)) != base  # same bytes, another shape
    assert checksum(x.view(torch.int32)) != base  # same bytes, another dtype
    assert checksum(x[:-1]) != base  # truncated
    stale = torch.cat([x[:-1], torch.zeros(1, 32)])  # the tail never written
    assert checksum(stale) != base
    assert checksum(torch.zeros(0)) != checksum(torch.zeros(0, 3))


def test_every_qtensor_field_counts():
    model = tiny()
    plan = resolve("nvfp4-dequantized", {n: p.shape for n, p in model.named_parameters()})
    name = "model.layers.0.mlp.experts.gate_up_proj"
    record = next(r for r in export_weights(model.named_parameters(), plan) if r.name == name)
    q = record.value
    assert isinstance(q, QTensor) and checksum(q) == record.hash
    for field in ("qdata", "scale", "global_scale"):
        t = getattr(q, field)
        changed = QTensor(
            **{
                "qdata": q.qdata,
                "scale": q.scale,
                "global_scale": q.global_scale,
                field: flipped(t, t.numel() * t.element_size() - 1),
            },
            fmt=q.fmt,
            shape=q.shape,
            axis=q.axis,
        )
        assert checksum(changed) != record.hash, field


@pytest.mark.parametrize("n", [ROW * 20 + 9, ROW * 3])
def test_the_gemm_and_the_elementwise_path_give_the_same_integers(n, monkeypatch):
    x = random_bytes(n, seed=1)
    rows = x[: (n // ROW) * ROW].view(torch.int8).view(-1, ROW)
    c = digest._coefficients(0, x.device)
    exact = rows.long() @ c.long()  # int64 reference: no overflow possible
    assert torch.equal(torch._int_mm(rows, c).long(), exact)
    assert torch.equal(digest._project_exact(rows, c).long(), exact)
    extreme = torch.full((32, ROW), -128, dtype=torch.int8)  # the largest |row sum|
    assert torch.equal(torch._int_mm(extreme, c).long(), extreme.long() @ c.long())
    base = checksum(x)
    monkeypatch.setitem(digest._INT_MM, x.device, False)
    assert checksum(x) == base


def test_checksums_of_many_equal_one_by_one():
    values = [torch.randn(5, 7), random_bytes(3 * ROW + 1), torch.ones((), dtype=torch.float32)]
    assert checksums(values) == [checksum(v) for v in values]


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
def test_cuda_checksum_equals_cpu(n):
    x = random_bytes(n, seed=n)
    assert checksum(x.cuda()) == checksum(x)
    assert checksum(x.cuda()[1:]) == checksum(x[1:])  # an unaligned view, read in place
    assert checksum(x.cuda(), backend="reference") == checksum(x)  # torch._int_mm on CUDA


needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (the CUDA fast path)"
)


@pytest.mark.gpu
@needs_triton
def test_cuda_kernel_equals_the_cpu_reference_on_a_large_tensor():
    """The Triton kernel on the GPU, 300 MiB + 5 bytes (four levels, a partial last row), and
    a model-like batch in the same call: the CPU reference's digests, byte for byte."""
    big = random_bytes(300 * 2**20 + 5, seed=11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(3, 256, 512, generator=g)
    q = [quantize(x, "mxfp8"), quantize(x, "nvfp4"), quantize(x, "nvfp4", per_token=True)]
    q.append(quantize(x, "fp8_block"))
    others = [
        torch.randn(4096, 2048, generator=g).to(torch.bfloat16),
        torch.randn(2048, generator=g).to(torch.bfloat16),
        *(t for v in q for t in v.tensors().values()),
        torch.zeros(0, dtype=torch.uint8),
    ]
    big_cuda = big.cuda()
    unaligned = big_cuda[3 : 5 * 2**20]  # a view at an odd address (slicing on the device)
    assert unaligned.data_ptr() % 2 == 1
    want = digest.field_digests([big, big[3 : 5 * 2**20], *others], backend="reference")
    cuda_fields = [big_cuda, unaligned, *(t.cuda() for t in others)]
    got = digest.field_digests(cuda_fields, backend="triton")
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), want)
    assert checksums([v.to("cuda") for v in q]) == checksums(q)  # the default backend on CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["bf16", "mxfp8", "nvfp4-dequantized", "fp8-block"])
def test_cuda_export_checksums_equal_the_cpu_export(preset):
    """Quantized on the GPU (Triton kernels where they apply) and checksummed there: the CPU
    reference's records, byte for byte."""
    model = engine_tiny(preset)
    plan = resolve(preset, {n: p.shape for n, p in model.named_parameters()})
    cpu = {r.name: r.hash for r in export_weights(model.named_parameters(), plan)}
    cuda = {r.name: r.hash for r in export_weights(model.cuda().named_parameters(), plan)}
    assert cuda == cpu
