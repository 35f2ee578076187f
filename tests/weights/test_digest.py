"""The device-side checksum: the record's name and every stored byte (every field of every
format), its position, dtype and shape count; the GEMM and the elementwise path give the same
integers; CPU and CUDA (the Triton kernel, and the reference there) give the same checksum. The
kernel under Triton's interpreter is tested in tests/kernels/test_digest_kernel.py."""

import dataclasses
import importlib
import importlib.util

import pytest
import torch

from mxrl.formats import QTensor, quantize
from mxrl.recipe import resolve
from mxrl.weights import checksum, checksums, export_weights
from tests.engine.test_engine import tiny as engine_tiny
from tests.sync.helpers import tiny

digest = importlib.import_module("mxrl.weights.digest")  # the module (mxrl.weights.digest is
# the function)
levels = importlib.import_module("mxrl.kernels.digest")

ROW = levels.ROW_BYTES
NAME = "model.layers.0.mlp.experts.gate_up_proj"


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
    base = checksum(NAME, x)
    assert checksum(NAME, x.clone()) == base
    positions = {0, n // 2, n - 1, max(0, n - ROW // 2)}
    for i in positions:
        for bit in (0, 7):
            assert checksum(NAME, flipped(x, i, bit)) != base, (i, bit)


def test_reordered_rows_bytes_and_experts_change_it():
    x = random_bytes(8 * ROW).view(8, ROW)
    base = checksum(NAME, x)
    assert checksum(NAME, x[[1, 0, *range(2, 8)]].contiguous()) != base  # two whole rows swapped
    y = x.clone()
    y[3, 10], y[3, 11] = x[3, 11].clone(), x[3, 10].clone()
    assert torch.equal(x, y) or checksum(NAME, y) != base  # two bytes swapped (if they differ)
    experts = torch.randn(4, 16, 64)
    assert checksum(NAME, experts.flip(0).contiguous()) != checksum(NAME, experts)


def test_dtype_shape_and_length_are_bound():
    x = torch.randn(64, 32)
    base = checksum(NAME, x)
    assert checksum(NAME, x.view(32, 64)) != base  # same bytes, another shape
    assert checksum(NAME, x.view(torch.int32)) != base  # same bytes, another dtype
    assert checksum(NAME, x[:-1]) != base  # truncated
    stale = torch.cat([x[:-1], torch.zeros(1, 32)])  # the tail never written
    assert checksum(NAME, stale) != base
    assert checksum(NAME, torch.zeros(0)) != checksum(NAME, torch.zeros(0, 3))


def _formats() -> dict[str, object]:
    """One value of every stored layout: each format, NVFP4 with each global-scale shape, MXFP8
    column-wise, 3-D experts, plain tensors."""
    g = torch.Generator().manual_seed(3)
    x, experts = torch.randn(64, 96, generator=g), torch.randn(4, 32, 64, generator=g)
    amax = experts.abs().amax(dim=(1, 2), keepdim=True)
    return {
        "mxfp8": quantize(x, "mxfp8"),
        "mxfp8_column_wise": quantize(x, "mxfp8", axis=0),
        "nvfp4_per_tensor": quantize(x, "nvfp4"),  # global_scale [] (0-d)
        "nvfp4_per_token": quantize(x, "nvfp4", per_token=True),  # global_scale [64, 1]
        "nvfp4_per_expert": quantize(experts, "nvfp4", global_amax=amax),  # [4, 1, 1]
        "fp8_block": quantize(x, "fp8_block", block=(32, 32)),
        "fp8_block_experts": quantize(experts, "fp8_block", block=(32, 32)),
        "fp8_block_1x32": quantize(x, "fp8_block", block=(1, 32)),
        "bf16": x.to(torch.bfloat16),
        "fp32": x,
    }


FORMATS = _formats()
FIELDS = [
    (fmt, field)
    for fmt, value in FORMATS.items()
    for field in (value.tensors() if isinstance(value, QTensor) else {"": value})
]


@pytest.mark.parametrize(("fmt", "field"), FIELDS, ids=[f"{f}-{k or 'tensor'}" for f, k in FIELDS])
def test_every_byte_of_every_field_of_every_format_counts(fmt, field):
    """A flipped bit in the first, a middle and the last byte of each field (a 0-d global scale
    too: 4 bytes, each of them) changes the checksum."""
    value = FORMATS[fmt]
    base = checksum(NAME, value)
    t = value.tensors()[field] if isinstance(value, QTensor) else value
    n = t.numel() * t.element_size()
    for i in sorted({0, n // 2, n - 1, *range(min(n, 4))}):
        changed = flipped(t, i, bit=i % 8)
        if isinstance(value, QTensor):
            changed = dataclasses.replace(value, **{field: changed})
        assert checksum(NAME, changed) != base, (fmt, field, i)


def test_the_name_is_bound():
    """The same bytes under another name have another checksum (a record swapped with another
    one, each carrying its own checksum, fails); names are JSON-quoted in the header, so a
    name holding a newline cannot pass for header lines."""
    q = FORMATS["nvfp4_per_expert"]
    other = "model.layers.1.mlp.experts.gate_up_proj"
    assert checksum(NAME, q) != checksum(other, q)
    assert checksums([NAME, other], [q, q]) == [checksum(NAME, q), checksum(other, q)]
    assert b'name|"a\\nqtensor"' in digest.header("a\nqtensor", q)
    assert digest.header(NAME, q).startswith(b"mxrl-checksum-v2\nname|")
    with pytest.raises(TypeError, match="one record name per value"):
        checksums([q], [q, q])


def test_export_records_carry_the_checksum_of_their_name():
    model = tiny()
    plan = resolve("nvfp4-dequantized", {n: p.shape for n, p in model.named_parameters()})
    for record in export_weights(model.named_parameters(), plan):
        assert checksum(record.name, record.value) == record.hash, record.name


@pytest.mark.parametrize("n", [ROW * 20 + 9, ROW * 3])
def test_the_gemm_and_the_elementwise_path_give_the_same_integers(n, monkeypatch):
    x = random_bytes(n, seed=1)
    rows = x[: (n // ROW) * ROW].view(torch.int8).view(-1, ROW)
    c = levels._coefficients(0, x.device)
    exact = rows.long() @ c.long()  # int64 reference: no overflow possible
    assert torch.equal(torch._int_mm(rows, c).long(), exact)
    assert torch.equal(levels._project_exact(rows, c).long(), exact)
    extreme = torch.full((32, ROW), -128, dtype=torch.int8)  # the largest |row sum|
    assert torch.equal(torch._int_mm(extreme, c).long(), extreme.long() @ c.long())
    base = checksum(NAME, x)
    monkeypatch.setitem(levels._INT_MM, x.device, False)
    assert checksum(NAME, x) == base


def test_checksums_of_many_equal_one_by_one():
    values = [torch.randn(5, 7), random_bytes(3 * ROW + 1), torch.ones((), dtype=torch.float32)]
    names = ["a", "b", "c"]
    assert checksums(names, values) == [checksum(n, v) for n, v in zip(names, values, strict=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
def test_cuda_checksum_equals_cpu(n):
    x = random_bytes(n, seed=n)
    assert checksum(NAME, x.cuda()) == checksum(NAME, x)
    assert checksum(NAME, x.cuda()[1:]) == checksum(NAME, x[1:])  # unaligned, read in place
    # torch._int_mm on CUDA
    assert checksum(NAME, x.cuda(), backend="reference") == checksum(NAME, x)


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
    want = levels.field_digests([big, big[3 : 5 * 2**20], *others], backend="reference")
    cuda_fields = [big_cuda, unaligned, *(t.cuda() for t in others)]
    got = levels.field_digests(cuda_fields, backend="triton")
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), want)
    names = [str(i) for i in range(len(q))]
    cuda_q = [v.to("cuda") for v in q]
    assert checksums(names, cuda_q) == checksums(names, q)  # the default backend on CUDA


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
