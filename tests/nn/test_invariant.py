"""mxrl.nn.invariant and the engine's other CPU building blocks: a value depends on its own
element (or row) only, never on where it lies in a tensor or what else is in it -- checked under
every CPU capability by the matrix (`make test`), where ATen's own kernels fail it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mxrl.models import RMSNorm, RotaryEmbedding
from mxrl.nn import invariant
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # the property under test is per capability

FUNCTIONS = {"exp": invariant.exp, "sigmoid": invariant.sigmoid, "silu": invariant.silu}


def _values(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 6


def _alone(fn, v: torch.Tensor) -> torch.Tensor:
    """Each element computed in a tensor of its own."""
    return torch.cat([fn(v[i : i + 1]) for i in range(v.numel())])


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_element_does_not_depend_on_its_position_or_neighbours(name, dtype):
    """Every window of a long vector (lengths around the vector widths of every capability and
    past ATen's 32768-element thread split) gives each element's value computed alone."""
    fn = FUNCTIONS[name]
    v = _values(400).to(dtype)
    want = _alone(fn, v)
    for start in range(0, 40, 3):
        for length in (1, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 200):
            got = fn(v[start : start + length])
            assert_bytes_equal(got, want[start : start + length], f"{name} [{start}:+{length}]")
    big = _values(70_001, seed=1).to(dtype)  # multi-threaded in ATen: slices end mid-vector
    for start in (0, 5, 32_767):
        assert_bytes_equal(fn(big[start:])[:100], fn(big[start : start + 100]), f"{name} {start}")


def test_exp_is_within_one_ulp_over_the_fp32_range():
    x = torch.cat([torch.linspace(-87.3, 88.7, 400_001), _values(100_000, seed=3) * 3])
    x = x.clamp(-87.3, 88.7)  # normal fp32 results: one ulp is well defined
    got = invariant.exp(x).double()
    want = torch.exp(x.double())
    w32 = want.float()
    ulp = (torch.nextafter(w32, torch.tensor(float("inf"))).double() - w32.double()).clamp(min=0)
    assert ((got - want).abs() / ulp).max() < 1.0


def test_special_values():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.8, -103.0, -200.0])
    e = invariant.exp(x)
    assert torch.isnan(e[0]) and e[1] == float("inf") and e[2] == 0 and e[3] == 1 and e[4] == 1
    assert e[5] == float("inf") and 0 < e[6] < 1e-44 and e[7] == 0  # overflow; subnormal; 0
    s = invariant.sigmoid(x)
    assert torch.isnan(s[0]) and s[1] == 1 and s[2] == 0 and s[3] == 0.5
    u = invariant.silu(x)
    assert torch.isnan(u[0]) and u[1] == float("inf") and u[3] == 0
    assert torch.isnan(u[2]) == torch.isnan(F.silu(x[2:3]))[0]  # -inf / inf, as torch


@pytest.mark.parametrize("name", ["sigmoid", "silu"])
def test_close_to_torch_and_gradients_match(name):
    fn, ref = FUNCTIONS[name], getattr(torch, name) if name == "sigmoid" else F.silu
    x = _values(10_000, seed=4).requires_grad_()
    y = fn(x)
    torch.testing.assert_close(y, ref(x), rtol=4e-7, atol=1e-30)
    (g,) = torch.autograd.grad(y.sum(), x)
    (g_ref,) = torch.autograd.grad(ref(x).sum(), x)
    # sigmoid' = s (1 - s): where s rounds near 1, (1 - s) carries one ulp of s (absolute 1e-7)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=2e-7)
    bf = x.detach().bfloat16().requires_grad_()
    assert fn(bf).dtype == torch.bfloat16
    (g_bf,) = torch.autograd.grad(fn(bf).float().sum(), bf)
    assert g_bf.dtype == torch.bfloat16


def test_float64_and_other_devices_keep_the_torch_functions():
    x = _values(100).double()
    assert torch.equal(invariant.silu(x), F.silu(x))
    assert torch.equal(invariant.exp(x), torch.exp(x))


def test_rope_values_of_a_position_do_not_depend_on_the_batch():
    rope = RotaryEmbedding(head_dim=48, theta=10_000.0)
    alone = {p: rope(torch.tensor([[p]]), torch.float32) for p in (0, 5, 255, 256, 700)}
    batch = torch.tensor([[9, 700, 5, 0, 255, 256, 3]])
    cos, sin = rope(batch, torch.float32)
    for i, p in enumerate(batch[0].tolist()):
        if p in alone:
            assert_bytes_equal(cos[0, i], alone[p][0][0, 0], f"cos {p}")
            assert_bytes_equal(sin[0, i], alone[p][1][0, 0], f"sin {p}")
    # and the values are RoPE's: cos / sin of the fp32 angles p * inv_freq (as transformers)
    freqs = (batch[0, :, None].float() * rope.inv_freq(torch.device("cpu"))).double()
    torch.testing.assert_close(cos[0, :, :24].double(), freqs.cos(), rtol=0, atol=2e-7)
    torch.testing.assert_close(sin[0, :, 24:].double(), freqs.sin(), rtol=0, atol=2e-7)
    with pytest.raises(ValueError, match="position_ids"):
        rope(torch.tensor([[-1, 2]]), torch.float32)


@pytest.mark.parametrize(("rows", "k", "n"), [(8, 64, 64), (16, 64, 128), (32, 128, 64)])
def test_fixed_shape_gemm_rows_do_not_depend_on_their_neighbours(rows, k, n):
    """What the engine's tiles rest on (docs/engine.md): at one fixed [rows, K] x [K, N] shape,
    the BLAS GEMM computes each output row from its own input row in an order fixed by the
    shape, wherever the row sits and whatever the other rows hold (checked per capability,
    with MKL's code path of that capability)."""
    g = torch.Generator().manual_seed(rows + k + n)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    want = F.linear(x, w)
    for shift in range(1, rows):
        got = F.linear(torch.roll(x, shift, 0), w)
        assert_bytes_equal(torch.roll(got, -shift, 0), want, f"rows rolled by {shift}")
    zeros = F.linear(torch.cat([x[:3], torch.zeros(rows - 3, k)]), w)
    assert_bytes_equal(zeros[:3], want[:3], "zero padding")


@pytest.mark.parametrize(("preset", "want"), [(None, "AUTO,STRICT"), ("COMPATIBLE", "COMPATIBLE")])
def test_import_mxrl_asks_mkl_for_strict_reproducibility_unless_the_environment_chose(preset, want):
    """MKL's AVX2 sgemm on an Intel CPU rounded a row by its place in a fixed-shape GEMM (the
    test above failed under the avx2 capability on a Xeon) unless MKL_CBWR asks for strict
    reproducibility: `import mxrl` sets it, before any GEMM of a process that imports it first,
    and keeps a value the user set (the golden run's COMPATIBLE)."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if preset is not None:
        env["MKL_CBWR"] = preset
    code = "import os, mxrl; print(os.environ['MKL_CBWR'])"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert out.stdout.strip() == want


@pytest.mark.parametrize("width", [8, 60, 64, 100])
def test_row_reductions_do_not_depend_on_other_rows(width):
    """RMSNorm, the router's softmax + top-k and the sampler's log-softmax: a row's bytes are
    the same in any slice of rows (the engine's second building block, docs/engine.md)."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(48, width, generator=g) * 3
    norm = RMSNorm(width, 1e-6)
    ops = {
        "rmsnorm": norm,
        "softmax": lambda t: F.softmax(t, dim=-1, dtype=torch.float32),
        "log_softmax": lambda t: torch.log_softmax(t, dim=-1),
        "topk": lambda t: torch.topk(F.softmax(t, dim=-1), 2, dim=-1).values,
    }
    with torch.no_grad():
        for name, op in ops.items():
            want = torch.cat([op(x[i : i + 1]) for i in range(48)])
            for start, rows in ((0, 48), (3, 8), (5, 32), (11, 17), (40, 1)):
                got = op(x[start : start + rows])
                assert_bytes_equal(got, want[start : start + rows], f"{name} [{start}:+{rows}]")


@pytest.mark.parametrize(("rows", "k", "n"), [(32, 16, 16), (64, 128, 16), (32, 16, 128)])
def test_a_batched_matmul_item_does_not_depend_on_the_batch(rows, k, n):
    """The engine's CPU attention batches fixed-shape [rows, K] x [K, N] products over
    (tile, key head) pairs whose number changes with the step: each item's bytes must be those
    it gets in a batch of one."""
    g = torch.Generator().manual_seed(rows * k + n)
    a = torch.randn(40, rows, k, generator=g)
    b = torch.randn(40, k, n, generator=g)
    want = torch.cat([torch.bmm(a[i : i + 1], b[i : i + 1]) for i in range(40)])
    for start, count in ((0, 40), (3, 7), (10, 2), (0, 33)):
        got = torch.bmm(a[start : start + count], b[start : start + count])
        assert_bytes_equal(got, want[start : start + count], f"items {start}..+{count}")
