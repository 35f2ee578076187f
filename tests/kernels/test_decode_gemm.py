"""Low-bit weight GEMMs (`mxrl.kernels.decode_gemm`) against the emulated GEMM, on the CPU.

- reference backend == `mxrl.nn.paths.reference.emulated_matmul`, bit for bit (no triton needed);
- the Triton kernel under Triton's interpreter (skipped without triton, or where CUDA is
  present: the GPU tier is test_decode_gemm_gpu.py), small shapes:
  * within `error_bound` on random inputs (awkward N and K: masks; split-K; grouped experts
    with empty experts and experts longer than one M tile);
  * bit for bit where every summation order gives the same sum ("exact-sum" inputs) and where
    each output is one product (one-hot activations decoding every weight byte and scale code);
  * split-K: the in-kernel reduction equals the sum of the partials in split order, bit for bit,
    and leaves its counters at zero.
The helpers here build the operands for the GPU tier as well.
"""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import QTensor
from mxrl.formats import quantize as reference_quantize
from mxrl.kernels.decode_gemm import (
    GemmConfig,
    choose_config,
    error_bound,
    grouped_low_bit_linear,
    grouped_low_bit_matmul,
    low_bit_linear,
    low_bit_matmul,
    reference_low_bit_matmul,
)
from tests.kernels import conftest

FORMATS = ["nvfp4", "mxfp8"]
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

_interpreter_ready = pytest.mark.skipif(
    not conftest.INTERPRETER_READY,
    reason="interpreter tests run without CUDA, with TRITON_INTERPRET=1 set before triton is "
    "imported (pytest tests/kernels, or TRITON_INTERPRET=1 pytest)",
)

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)
# NumPy's IEEE division by zero in masked lanes (1/0 -> inf, never stored)
_numpy_div0 = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.*")


def interpreter(fn):
    return pytest.mark.triton(_interpreter_ready(_numpy_div0(fn)))


# --- operands ------------------------------------------------------------------------------------


def act_kwargs(fmt: str, per_token: bool = True) -> dict:
    return {"per_token": per_token} if fmt == "nvfp4" else {}


def quantize_weight(w: torch.Tensor, fmt: str, scale: str = "tensor") -> QTensor:
    """NVFP4 weight global scales as the plan gives them: "tensor" (2-D) or "expert" ([E, 1, 1]);
    "rows" ([..., N, 1]: per row, e.g. gate_up halves). MXFP8 has none."""
    if fmt == "mxfp8":
        return reference_quantize(w, "mxfp8")
    mag = w.float().abs()
    if scale == "tensor":
        return reference_quantize(w, "nvfp4")
    if scale == "expert":
        return reference_quantize(w, "nvfp4", global_amax=mag.amax(dim=(1, 2), keepdim=True))
    return reference_quantize(w, "nvfp4", global_amax=mag.amax(dim=-1, keepdim=True))


def random_operands(fmt, t, n, k, *, e=None, seed=0, x_dtype=torch.bfloat16, device="cpu"):
    """x [T, K] (one all-zero row when T > 2) and w [N, K] or [E, N, K], high precision."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * 3.0
    if t > 2:
        x[1] = 0.0
    w_shape = (n, k) if e is None else (e, n, k)
    w = torch.randn(w_shape, generator=g) * 0.02
    return x.to(x_dtype).to(device), w.to(device)


def exact_operands(fmt, t, n, k, *, e=None, seed=0, device="cpu"):
    """x, w whose quantized GEMM sums exactly in fp32 in any order (K <= 2048).

    NVFP4: values on the E2M1 grid with a ±6 in every 16-block, times a per-row / per-expert
    factor: every block scale is 448, so lp = e2m1 * 448 and products are 49 * 2^10 times an
    integer of magnitude <= 144 (exact sums while 49 * 144 * K < 2^24). MXFP8: multiples of
    1/16 in [-1, 1] with a ±1 in every 32-block (w: times 2^-6): lp = the value, products are
    multiples of 2^-14 below 2^-6 in magnitude."""
    assert k <= 2048
    g = torch.Generator().manual_seed(seed)
    lead = (n,) if e is None else (e, n)
    if fmt == "nvfp4":
        xg = E2M1_GRID[torch.randint(0, 8, (t, k), generator=g)]
        wg = E2M1_GRID[torch.randint(0, 8, (*lead, k), generator=g)]
        block, top = 16, 6.0
        x_factor = torch.rand(t, 1, generator=g) + 0.5
        w_factor = 0.01 if e is None else (torch.rand(e, 1, 1, generator=g) + 0.5) * 0.01
    else:
        xg = torch.randint(0, 17, (t, k), generator=g).float() / 16
        wg = torch.randint(0, 17, (*lead, k), generator=g).float() / 16
        block, top = 32, 1.0
        x_factor, w_factor = 1.0, 2.0**-6
    xg[..., ::block] = top
    wg[..., ::block] = top
    xg = xg * torch.where(torch.rand(xg.shape, generator=g) < 0.5, -1.0, 1.0)
    wg = wg * torch.where(torch.rand(wg.shape, generator=g) < 0.5, -1.0, 1.0)
    x = xg * x_factor
    if t > 2:
        x[1] = 0.0
    return x.to(device), (wg * w_factor).to(device)


def quantize_pair(fmt, x, w, *, w_scale="tensor", per_token=True):
    return reference_quantize(x, fmt, **act_kwargs(fmt, per_token)), quantize_weight(
        w, fmt, w_scale
    )


def offsets_for(counts, device="cpu", dtype=torch.int64) -> torch.Tensor:
    off = torch.zeros(len(counts) + 1, dtype=dtype)
    off[1:] = torch.tensor(counts).cumsum(0)
    return off.to(device)


def assert_within_bound(y, xq, wq, offsets=None, what=""):
    ref = reference_low_bit_matmul(xq, wq, offsets)
    bound = error_bound(xq, wq, offsets)
    err = (y.float() - ref).abs()
    bad = ~(err <= bound)
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} outputs outside the bound; worst err "
        f"{float(err.max()):.3g}, bound there {float(bound.reshape(-1)[err.argmax()]):.3g}"
    )
    return float(err.max()), float((err / bound.clamp_min(1e-30)).max())


def assert_bitwise(y, ref, what=""):
    assert y.dtype == ref.dtype and y.shape == ref.shape, (y.dtype, ref.dtype, y.shape, ref.shape)
    a, b = y.detach().cpu(), ref.detach().cpu()
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b)), f"{what}: NaN positions differ"
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    diff = (a.view(as_int) != b.view(as_int)) & ~nan
    assert not bool(diff.any()), (
        f"{what}: {int(diff.sum())} of {a.numel()} outputs differ; first got "
        f"{a[diff][0].item()!r}, want {b[diff][0].item()!r}"
    )


def one_hot_activation(fmt, k, device="cpu"):
    """x [K, K] diagonal: row i's lp is a single non-zero value at column i (NVFP4: code 6 times
    block scale 448; MXFP8: 448 with E8M0 scale 2^0), so y[i, n] is one exact product with
    lp_w[n, i], the same bits whatever the summation order."""
    x = torch.eye(k, device=device)
    if fmt == "mxfp8":
        x = x * 448.0  # E8M0 scale 2^0, code 0x7E
    return reference_quantize(x, fmt, **act_kwargs(fmt))


def random_code_weight(fmt, n, k, *, seed=0, device="cpu", scale_codes=(40, 215)) -> QTensor:
    """A weight QTensor with every byte value (NVFP4: every pair of E2M1 codes; MXFP8: every E4M3
    byte, NaN codes in the first rows only) and random block scales: NVFP4 every E4M3 code 0..0x7E, MXFP8
    E8M0 codes in `scale_codes` (keeps lp within bf16's normal range, module docstring of
    triton_gemm)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // (2 if fmt == "nvfp4" else 1)), generator=g)
    q.view(-1)[:256] = torch.arange(256)
    if fmt == "nvfp4":
        s = torch.randint(0, 0x7F, (n, k // 16), generator=g).to(torch.uint8)
        s.view(-1)[:0x7F] = torch.arange(0x7F, dtype=torch.uint8)
        gs = torch.tensor(1234.5)
        return QTensor(q.to(torch.uint8), s.view(torch.float8_e4m3fn), "nvfp4", (n, k), -1, gs).to(
            device
        )
    # A NaN weight makes its whole output column NaN (0 * NaN in every sum, as in the
    # reference): keep the NaN codes 0x7F / 0xFF to the rows that hold every byte value.
    head = -(-256 // k)
    tail = q[head:]
    tail[(tail & 0x7F) == 0x7F] -= 1
    lo, hi = scale_codes
    s = torch.randint(lo, hi + 1, (n, k // 32), generator=g).to(torch.uint8)
    return QTensor(q.to(torch.uint8), s.view(torch.float8_e8m0fnu), "mxfp8", (n, k)).to(device)


# --- reference backend (no triton) ---------------------------------------------------------------


def _spec(fmt, shape, per_token=True):
    from mxrl.recipe import TensorSpec

    extra = {"activations": "per_token" if per_token else "per_tensor"} if fmt == "nvfp4" else {}
    return TensorSpec(
        name="model.layers.0.mlp.experts.down_proj",
        shape=shape,
        kind="routed_expert",
        layer=0,
        expert=None,
        role="down",
        format=fmt,
        **extra,
    )


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_backend_is_emulated_matmul(fmt, per_token):
    from mxrl.nn.paths.reference import emulated_matmul
    from mxrl.nn.weight import QWeight

    x, w = random_operands(fmt, 7, 48, 96, x_dtype=torch.float32)
    wq = quantize_weight(w, fmt)
    want, _ = emulated_matmul(x, QWeight.from_qtensor(wq), _spec(fmt, (48, 96), per_token))
    got = low_bit_linear(x, wq, act_per_token=per_token, backend="reference")
    assert_bitwise(got, want, f"{fmt} per_token={per_token}")


@pytest.mark.parametrize("w_scale", ["expert", "rows"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_reference_is_per_expert_emulated_matmul(fmt, w_scale):
    from mxrl.nn.paths.reference import emulated_matmul
    from mxrl.nn.weight import QWeight

    counts = [3, 0, 5, 1]
    x, w = random_operands(fmt, sum(counts), 32, 64, e=4, x_dtype=torch.float32)
    wq = quantize_weight(w, fmt, w_scale)
    qw = QWeight.from_qtensor(wq)
    got = grouped_low_bit_linear(x, wq, offsets_for(counts), backend="reference")
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        want, _ = emulated_matmul(x[start : start + c], qw.for_expert(e), _spec(fmt, (32, 64)))
        assert_bitwise(got[start : start + c], want, f"expert {e}")
        start += c


def test_api_errors():
    x, w = random_operands("nvfp4", 4, 32, 64, e=2)
    wq3 = quantize_weight(w, "nvfp4", "expert")
    xq = reference_quantize(x, "nvfp4", per_token=True)
    wq2 = quantize_weight(w[0], "nvfp4")
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        low_bit_linear(x, wq3, backend="reference")
    with pytest.raises(ValueError, match="E \\+ 1"):
        grouped_low_bit_linear(x, wq3, offsets_for([4]), backend="reference")
    with pytest.raises(ValueError, match="rise from 0"):
        grouped_low_bit_linear(x, wq3, offsets_for([1, 2]), backend="reference")
    with pytest.raises(ValueError, match="K differs"):
        low_bit_linear(x[:, :32], wq2, backend="reference")
    with pytest.raises(ValueError, match="nvfp4 or mxfp8"):
        low_bit_linear(x, reference_quantize(w[0], "fp8_block", block=(16, 16)))
    with pytest.raises(ValueError, match="activation must be"):
        low_bit_matmul(reference_quantize(x, "mxfp8"), wq2, backend="reference")
    with pytest.raises(ValueError, match="int32/int64"):
        grouped_low_bit_matmul(xq, wq3, offsets_for([2, 2]).float(), backend="reference")
    with pytest.raises(ValueError, match="power of two"):
        GemmConfig(block_n=48)
    with pytest.raises(ValueError, match="dot"):
        GemmConfig(dot="tf32")


def test_low_bit_linear_keeps_leading_dims_and_dtype():
    x, w = random_operands("mxfp8", 6, 32, 64)
    wq = quantize_weight(w, "mxfp8")
    y = low_bit_linear(x.reshape(2, 3, 64), wq, backend="reference")
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    flat = low_bit_linear(x, wq, backend="reference", out_dtype=torch.float32)
    assert_bitwise(y.reshape(6, 32), flat.to(torch.bfloat16))


def test_choose_config_reads_weights_once_per_decode_batch():
    for m in (1, 8, 32, 128):
        cfg = choose_config(m, 1, 4096, 2048, 132)
        assert cfg.block_m >= m  # one M tile: every weight byte is read by one program
        assert (2048 // cfg.split_k) % cfg.block_k == 0
    assert choose_config(1, 1, 4096, 2048, 132).split_k > 1  # 64 N tiles alone: < 132 SMs


# --- the Triton kernel under the interpreter -----------------------------------------------------

SMALL = GemmConfig(block_m=16, block_n=32, block_k=64, split_k=1, num_stages=1)


def _cfg(**kw) -> GemmConfig:
    return GemmConfig(**{**SMALL.__dict__, **kw})


@interpreter
@pytest.mark.parametrize(("split_k", "block_m"), [(1, 16), (3, 16), (2, 64)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dense_within_bound(fmt, split_k, block_m):
    # N = 80: a partial N tile; K = 224 (mxfp8) / 208 (nvfp4): K not a multiple of block_k.
    # MXFP8: block_m <= 32 runs one dot per scale block, larger block_m decodes to lp first.
    k = 224 if fmt == "mxfp8" else 208
    x, w = random_operands(fmt, 19, 80, k)
    xq, wq = quantize_pair(fmt, x, w)
    y = low_bit_matmul(xq, wq, backend="triton", config=_cfg(split_k=split_k, block_m=block_m))
    assert y.shape == (19, 80) and y.dtype == torch.float32
    assert_within_bound(y, xq, wq, what=f"{fmt} split {split_k}")


@interpreter
@pytest.mark.parametrize(("split_k", "block_m"), [(1, 1), (3, 2), (2, 8)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fma_dot_within_bound_and_exact(fmt, split_k, block_m):
    """The CUDA-core dot (dot="fma", any block_m): within the bound on random inputs, bit for
    bit on exact-sum inputs, dense and grouped."""
    k = 224 if fmt == "mxfp8" else 208
    cfg = _cfg(split_k=split_k, block_m=block_m, dot="fma")
    x, w = random_operands(fmt, 5, 80, k)
    xq, wq = quantize_pair(fmt, x, w)
    assert_within_bound(low_bit_matmul(xq, wq, backend="triton", config=cfg), xq, wq)
    x, w = exact_operands(fmt, 5, 64, 256)
    xq, wq = quantize_pair(fmt, x, w)
    y = low_bit_matmul(xq, wq, backend="triton", config=cfg)
    assert_bitwise(y, reference_low_bit_matmul(xq, wq), f"{fmt} fma exact")
    counts = [0, 3, 1, 0]
    off = offsets_for(counts)
    x, w = random_operands(fmt, sum(counts), 48, 128, e=len(counts))
    xq, wq = quantize_pair(fmt, x, w)
    y = grouped_low_bit_matmul(xq, wq, off, backend="triton", config=cfg)
    assert_within_bound(y, xq, wq, off, f"{fmt} grouped fma")


def test_tensor_core_configs_need_sixteen_rows():
    with pytest.raises(ValueError, match="block_m=8"):
        GemmConfig(block_m=8)
    assert GemmConfig(block_m=1, dot="fma").block_m == 1


@interpreter
@pytest.mark.parametrize("fmt", FORMATS)
def test_dense_even_tiles_and_per_tensor_activation(fmt):
    x, w = random_operands(fmt, 5, 64, 256)
    xq, wq = quantize_pair(fmt, x, w, per_token=False)
    cfg = _cfg(block_k=128, split_k=2, block_n=64)
    y = low_bit_matmul(xq, wq, backend="triton", config=cfg)
    assert_within_bound(y, xq, wq, what=fmt)


@interpreter
@pytest.mark.parametrize(("split_k", "block_m"), [(1, 16), (2, 32), (2, 64)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_exact_sums_are_bit_identical(fmt, split_k, block_m):
    x, w = exact_operands(fmt, 21, 64, 256)
    xq, wq = quantize_pair(fmt, x, w)
    y = low_bit_matmul(xq, wq, backend="triton", config=_cfg(split_k=split_k, block_m=block_m))
    assert_bitwise(y, reference_low_bit_matmul(xq, wq), f"{fmt} exact")
    assert float(y.abs().max()) > 0


@interpreter
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_weight_code_decodes_exactly(fmt):
    k, n = 64, 64
    xq = one_hot_activation(fmt, k)
    wq = random_code_weight(fmt, n, k)
    for block_m in (32, 64):
        y = low_bit_matmul(xq, wq, backend="triton", config=_cfg(block_m=block_m))
        assert_bitwise(y, reference_low_bit_matmul(xq, wq), f"{fmt} one-hot block_m={block_m}")


@interpreter
@pytest.mark.parametrize(
    ("fmt", "w_scale"), [("nvfp4", "expert"), ("nvfp4", "rows"), ("mxfp8", "")]
)
def test_grouped_within_bound_and_exact(fmt, w_scale):
    counts = [0, 3, 0, 37, 1, 0]  # empty first/last experts; 37 rows = three M tiles
    t, n, k = sum(counts), 48, 128
    off = offsets_for(counts)
    x, w = random_operands(fmt, t, n, k, e=len(counts))
    xq, wq = quantize_pair(fmt, x, w, w_scale=w_scale or "tensor")
    for split_k in (1, 2):
        y = grouped_low_bit_matmul(xq, wq, off, backend="triton", config=_cfg(split_k=split_k))
        assert_within_bound(y, xq, wq, off, f"{fmt} grouped split {split_k}")
    x, w = exact_operands(fmt, t, n, k, e=len(counts))
    xq, wq = quantize_pair(fmt, x, w, w_scale=w_scale or "tensor")
    y = grouped_low_bit_matmul(xq, wq, off.to(torch.int32), backend="triton", config=_cfg())
    assert_bitwise(y, reference_low_bit_matmul(xq, wq, off), f"{fmt} grouped exact")


@interpreter
def test_grouped_linear_bf16_out_is_the_fp32_result_rounded():
    counts = [2, 0, 5]
    x, w = random_operands("nvfp4", 7, 32, 64, e=3)
    wq = quantize_weight(w, "nvfp4", "expert")
    off = offsets_for(counts)
    y16 = grouped_low_bit_linear(x, wq, off, backend="triton", config=_cfg())
    y32 = grouped_low_bit_linear(
        x, wq, off, backend="triton", config=_cfg(), out_dtype=torch.float32
    )
    assert y16.dtype == torch.bfloat16
    assert_bitwise(y16, y32.to(torch.bfloat16), "bf16 output")
    yh = grouped_low_bit_linear(
        x, wq, off, backend="triton", config=_cfg(), out_dtype=torch.float16
    )
    assert_bitwise(
        yh.view(torch.int16).to(torch.int32),
        y32.to(torch.float16).view(torch.int16).to(torch.int32),
    )


@interpreter
@pytest.mark.parametrize("fmt", FORMATS)
def test_split_k_reduction_is_the_partials_summed_in_order(fmt):
    from mxrl.kernels import triton_gemm as tg

    x, w = random_operands(fmt, 9, 64, 256)
    xq, wq = quantize_pair(fmt, x, w)
    counters = tg.split_k_counters(xq.device, 64)
    args = _launch_args(xq, wq, counters, fmt, split_k=4)
    y, _ = tg.launch_low_bit_gemm(*args, reduce=True)
    _, part = tg.launch_low_bit_gemm(*args, reduce=False)
    assert part.shape == (4, 9, 64)
    assert int(counters.abs().sum()) == 0, "the last program must reset its counter"
    assert_bitwise(y, partials_reduced(part, xq, wq), f"{fmt} split-K")


def _launch_args(xq, wq, counters, fmt, split_k, block_m=16, block_n=32, block_k=64, hw=False):
    from mxrl.kernels import triton_gemm as tg

    return (
        xq.qdata,
        xq.scale.view(torch.uint8),
        xq.global_scale,
        wq.qdata,
        wq.scale.view(torch.uint8),
        wq.global_scale,
        None,
        counters,
        tg.FMT_CODES[fmt],
        torch.float32,
        block_m,
        block_n,
        block_k,
        split_k,
        0,
        4,
        1,
        False,
        hw,
        hw,
    )


def partials_reduced(part: torch.Tensor, xq: QTensor, wq: QTensor) -> torch.Tensor:
    """((p0 + p1) + p2) + ... then * fl(s_x * s_w): the kernel's reduction, in torch."""
    from mxrl.formats import decode_global_scale

    total = part[0].clone()
    for s in range(1, part.shape[0]):
        total = total + part[s]
    s_x, s_w = decode_global_scale(xq), decode_global_scale(wq)
    if s_x is None:
        return total
    return total * (s_x * (s_w if s_w.dim() == 0 else s_w.reshape(1, -1)))
