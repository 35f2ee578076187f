"""GPU tier for the low-bit weight GEMMs (`pytest -m gpu`): the compiled kernels (bf16 tensor-core
dot, hardware E4M3 decode) against the emulated GEMM on the same GPU.

- Qwen3-30B-A3B shapes at M = 1, 8, 32, 128 rows (per active expert when grouped), NVFP4 and
  MXFP8, default launch configs: within `error_bound`; bf16 output = fp32 output rounded;
- bit for bit on exact-sum inputs and one-hot activations (every weight byte and scale code),
  with the tensor-core and the "ieee" dot, NVFP4 decoded by the inline PTX and by Triton ops,
  MXFP8 through per-scale-block dots (block_m <= 32) and through decoded values (larger), and
  with the interpreter's code path compiled for the GPU;
- split-K: the in-kernel reduction equals the partials summed in order, is deterministic over
  repeated launches and leaves its counters at zero;
- the op under FakeTensorMode, torch.compile(fullgraph=True) and a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from mxrl.kernels import quantize
from mxrl.kernels.decode_gemm import (
    GemmConfig,
    choose_config,
    grouped_low_bit_linear,
    grouped_low_bit_matmul,
    low_bit_linear,
    low_bit_matmul,
    reference_low_bit_matmul,
)
from tests.kernels.test_decode_gemm import (
    FORMATS,
    _launch_args,
    act_kwargs,
    assert_bitwise,
    assert_within_bound,
    exact_operands,
    offsets_for,
    one_hot_activation,
    partials_reduced,
    quantize_pair,
    quantize_weight,
    random_code_weight,
)

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")

DENSE_SHAPES = {"q_proj": (4096, 2048), "kv_proj": (512, 2048), "o_proj": (2048, 4096)}
EXPERT_SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}
NUM_EXPERTS, ACTIVE = 128, 8
MS = [1, 8, 32, 128]
DEV = "cuda"


@pytest.fixture(autouse=True, scope="module")
def _no_tf32():
    # the reference GEMM must be a true fp32 GEMM (torch's default; asserted, not assumed)
    assert not torch.backends.cuda.matmul.allow_tf32
    yield


_WEIGHTS: dict = {}


def weight(fmt: str, n: int, k: int, experts: int | None = None):
    key = (fmt, n, k, experts)
    if key not in _WEIGHTS:
        g = torch.Generator(device=DEV).manual_seed(n * 7 + k)
        shape = (n, k) if experts is None else (experts, n, k)
        w = torch.randn(shape, generator=g, device=DEV) * 0.02
        _WEIGHTS[key] = quantize_weight(w, fmt, "tensor" if experts is None else "expert")
    return _WEIGHTS[key]


def activation(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=DEV) * 3.0
    if m > 2:
        x[1] = 0.0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("shape", list(DENSE_SHAPES), ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dense_qwen_shapes(fmt, shape, m):
    n, k = DENSE_SHAPES[shape]
    wq = weight(fmt, n, k)
    x = activation(m, k)
    xq = quantize(x, fmt, **act_kwargs(fmt))
    y = low_bit_matmul(xq, wq)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_within_bound(y, xq, wq, what=f"{fmt} {shape} M={m}")
    y16 = low_bit_linear(x, wq)  # same config: the fp32 result rounded once
    assert y16.dtype == torch.bfloat16
    assert_bitwise(y16, y.to(torch.bfloat16), f"{fmt} {shape} M={m} bf16 out")


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("shape", list(EXPERT_SHAPES), ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_qwen_shapes(fmt, shape, m):
    """8 of 128 experts active, m rows each (the benchmark's layout)."""
    n, k = EXPERT_SHAPES[shape]
    wq = weight(fmt, n, k, NUM_EXPERTS)
    g = torch.Generator().manual_seed(m)
    active = torch.randperm(NUM_EXPERTS, generator=g)[:ACTIVE].tolist()
    counts = [m if e in active else 0 for e in range(NUM_EXPERTS)]
    off = offsets_for(counts, DEV)
    x = activation(m * ACTIVE, k, seed=m)
    xq = quantize(x, fmt, **act_kwargs(fmt))
    y = grouped_low_bit_matmul(xq, wq, off, active_experts=ACTIVE)
    assert_within_bound(y, xq, wq, off, f"{fmt} {shape} M={m} grouped")
    y_default = grouped_low_bit_matmul(xq, wq, off)  # no hint: another split, same bound
    assert_within_bound(y_default, xq, wq, off, f"{fmt} {shape} M={m} grouped, no hint")
    y16 = grouped_low_bit_linear(x, wq, off, active_experts=ACTIVE)
    assert_bitwise(y16, y.to(torch.bfloat16), f"{fmt} {shape} M={m} grouped bf16 out")


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_top8_routing(fmt):
    """Real routing: 24 tokens, top-8 of 128 experts, rows sorted by expert."""
    n, k = EXPERT_SHAPES["gate_up"]
    wq = weight(fmt, n, k, NUM_EXPERTS)
    g = torch.Generator().manual_seed(3)
    ids = torch.rand(24, NUM_EXPERTS, generator=g).topk(ACTIVE, dim=-1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=NUM_EXPERTS).tolist()
    off = offsets_for(counts, DEV, torch.int32)
    xq = quantize(activation(len(ids), k, seed=5), fmt, **act_kwargs(fmt))
    y = grouped_low_bit_matmul(xq, wq, off)
    assert_within_bound(y, xq, wq, off, f"{fmt} top-8 routing")


# (dot, NVFP4 decode): the fast path, NVFP4 decoded by Triton ops instead of the inline PTX,
# the CUDA-core dot of few-row decode, and the fp32 tl.dot with IEEE adds
PATHS = [("bf16", "asm"), ("bf16", "triton"), ("fma", "asm"), ("ieee", "asm")]
PATH_IDS = ["-".join(p) for p in PATHS]


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize(("dot", "decode"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_exact_sums_bit_identical(fmt, dot, decode, split_k):
    for m, block_m in ((5, 16), (32, 32), (100, 64), (128, 128)):
        x, w = exact_operands(fmt, m, 512, 2048, device=DEV)
        xq, wq = quantize_pair(fmt, x, w)
        if dot == "ieee":
            cfg = GemmConfig.ieee(block_m, split_k)
        elif dot == "fma":
            cfg = GemmConfig(min(block_m, 8), 32, 256, split_k, dot="fma")
        else:
            cfg = choose_config(m, 1, 512, 2048, 132)
            cfg = GemmConfig(**{**cfg.__dict__, "split_k": split_k, "block_m": block_m})
        cfg = GemmConfig(**{**cfg.__dict__, "nvfp4_decode": decode})
        y = low_bit_matmul(xq, wq, config=cfg)
        assert_bitwise(y, reference_low_bit_matmul(xq, wq), f"{fmt} {dot} split {split_k} M={m}")
    counts = [0, 7, 40, 0, 1, 0, 13, 0]
    x, w = exact_operands(fmt, sum(counts), 256, 1024, e=len(counts), device=DEV)
    xq, wq = quantize_pair(fmt, x, w, w_scale="expert")
    off = offsets_for(counts, DEV)
    cfg = GemmConfig.ieee(16, split_k) if dot == "ieee" else GemmConfig(16, 64, 128, split_k)
    if dot == "fma":
        cfg = GemmConfig(2, 32, 128, split_k, dot="fma")
    cfg = GemmConfig(**{**cfg.__dict__, "nvfp4_decode": decode})
    y = grouped_low_bit_matmul(xq, wq, off, config=cfg)
    assert_bitwise(y, reference_low_bit_matmul(xq, wq, off), f"{fmt} {dot} grouped exact")


@pytest.mark.parametrize(("dot", "decode"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_weight_code_decodes_exactly(fmt, dot, decode):
    k, n = 256, 512
    xq = one_hot_activation(fmt, k, DEV)
    wq = random_code_weight(fmt, n, k, device=DEV)
    for block_m in (16, 64):
        cfg = GemmConfig.ieee(block_m, 2) if dot == "ieee" else GemmConfig(block_m, 64, 128, 2)
        if dot == "fma":
            cfg = GemmConfig(block_m // 16, 32, 128, 2, dot="fma")  # block_m 1 and 4
        cfg = GemmConfig(**{**cfg.__dict__, "nvfp4_decode": decode})
        y = low_bit_matmul(xq, wq, config=cfg)
        assert_bitwise(y, reference_low_bit_matmul(xq, wq), f"{fmt} one-hot block_m={block_m}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_interpreter_code_path_on_the_gpu(fmt):
    """HW=False (integer E4M3 decode, bf16 round trip + fp32 dot, integer bf16 rounding): the
    path the CPU interpreter tests check, compiled for sm_90, agrees with the HW path."""
    from mxrl.kernels import triton_gemm as tg

    counters = tg.split_k_counters(torch.device(DEV), 1 << 10)
    x, w = exact_operands(fmt, 9, 512, 1024, device=DEV)
    xq, wq = quantize_pair(fmt, x, w)
    y, _ = tg.launch_low_bit_gemm(*_launch_args(xq, wq, counters, fmt, split_k=2, hw=False))
    assert_bitwise(y, reference_low_bit_matmul(xq, wq), f"{fmt} HW=False exact")
    xq = one_hot_activation(fmt, 128, DEV)
    wq = random_code_weight(fmt, 128, 128, device=DEV)
    y, _ = tg.launch_low_bit_gemm(*_launch_args(xq, wq, counters, fmt, split_k=1, hw=False))
    assert_bitwise(y, reference_low_bit_matmul(xq, wq), f"{fmt} HW=False one-hot")


@pytest.mark.parametrize("fmt", FORMATS)
def test_split_k_reduction_is_deterministic(fmt):
    from mxrl.kernels import triton_gemm as tg

    n, k = DENSE_SHAPES["q_proj"]
    wq = weight(fmt, n, k)
    xq = quantize(activation(8, k, seed=9), fmt, **act_kwargs(fmt))
    counters = tg.split_k_counters(torch.device(DEV), 1 << 12)
    args = _launch_args(xq, wq, counters, fmt, split_k=8, block_n=64, block_k=128, hw=True)
    first, _ = tg.launch_low_bit_gemm(*args)
    for _ in range(50):
        again, _ = tg.launch_low_bit_gemm(*args)
        assert_bitwise(again, first, f"{fmt} split-K repeat")
    torch.cuda.synchronize()
    assert int(counters.abs().sum()) == 0, "split-K counters must return to zero"
    _, part = tg.launch_low_bit_gemm(*args, reduce=False)
    assert_bitwise(first, partials_reduced(part, xq, wq), f"{fmt} split-K order")
    assert_within_bound(first, xq, wq, what=f"{fmt} split-K")


def test_in_a_cuda_graph():
    n, k = DENSE_SHAPES["q_proj"]
    wq = weight("nvfp4", n, k)
    x = activation(8, k, seed=1)
    eager = low_bit_linear(x, wq)  # compiles and allocates the counters outside the capture
    static_x = torch.zeros_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        low_bit_linear(static_x, wq)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = low_bit_linear(static_x, wq)
    for _ in range(3):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(out, eager, "graph replay")


def _op_args(xq, wq, counters, out_dtype=torch.bfloat16, split_k=4):
    from mxrl.kernels import triton_gemm as tg

    args = list(_launch_args(xq, wq, counters, "nvfp4", split_k, block_n=64, block_k=128, hw=True))
    args[9] = out_dtype
    return tuple(args), tg


def test_op_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    xq, wq = quantize_pair("nvfp4", *exact_operands("nvfp4", 3, 128, 256, device=DEV))
    real_counters = torch.zeros(64, dtype=torch.int32, device=DEV)
    args, tg = _op_args(xq, wq, real_counters)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in args[:6]]
        counters = mode.from_tensor(real_counters)
        y = tg.low_bit_gemm(*fake, None, counters, *args[8:])
        assert y.shape == (3, 128) and y.dtype == torch.bfloat16 and y.device.type == "cuda"


def test_op_under_torch_compile_fullgraph():
    from mxrl.kernels import triton_gemm as tg

    xq, wq = quantize_pair("nvfp4", *exact_operands("nvfp4", 8, 512, 1024, device=DEV))
    counters = torch.zeros(1024, dtype=torch.int32, device=DEV)
    args, _ = _op_args(xq, wq, counters)

    def gemm(xq_data, counters):
        return tg.low_bit_gemm(xq_data, *args[1:7], counters, *args[8:])

    eager = gemm(xq.qdata, counters)
    compiled = torch.compile(gemm, fullgraph=True)(xq.qdata, counters)
    assert_bitwise(compiled, eager, "torch.compile")
    torch.cuda.synchronize()
    assert int(counters.abs().sum()) == 0
