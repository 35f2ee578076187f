"""The trainer's fused RoPE (mxrl.kernels.rope_train): forward and backward the bytes of the eager
ops and their autograd (rope_reference), under Triton's interpreter and (`gpu`) on CUDA; the
model's ApplyRope runs it where the row-wise kernels are Triton. The PTX check (no FMA in the
fp32 launch) is in test_rowwise_compile.py."""

from __future__ import annotations

import pytest
import torch

from mxrl.kernels import Backend
from mxrl.kernels.rope_train import rope_train, rope_train_fits
from mxrl.kernels.rowwise import rope_reference
from mxrl.models.layers import ApplyRope, RotaryEmbedding
from tests.kernels.test_decode_gemm import interpreter
from tests.numerics import assert_bytes_equal


def _inputs(dtype, d=16, b=3, s=5, n=4, nk=2, device="cpu", seed=0):
    """q and k as the model hands them over (transposed views of [B, S, heads, D]), the angles
    in their dtype as RotaryEmbedding gives them, a gradient for each output."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, s, n, d, generator=g) * 4).to(dtype).transpose(1, 2)
    k = (torch.randn(b, s, nk, d, generator=g) * 4).to(dtype).transpose(1, 2)
    positions = torch.randint(0, 70000, (b, s), generator=g)
    cos, sin = RotaryEmbedding(d, 1e6)(positions, dtype)
    gq = torch.randn(b, n, s, d, generator=g).to(dtype)
    gk = torch.randn(b, nk, s, d, generator=g).to(dtype)
    return [t.to(device) for t in (q, k, cos, sin, gq, gk)]


def _run(fn, q, k, cos, sin, gq, gk):
    q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    oq, ok = fn(q, k, cos, sin)
    torch.autograd.backward((oq, ok), (gq, gk))
    return oq.detach(), ok.detach(), q.grad, k.grad


def _check_bytes(dtype, device, **kw):
    q, k, cos, sin, gq, gk = _inputs(dtype, device=device, **kw)
    assert rope_train_fits(q, k, cos, sin)
    got = _run(rope_train, q, k, cos, sin, gq, gk)
    want = _run(rope_reference, q, k, cos, sin, gq, gk)
    for name, a, b in zip(("q", "k", "dq", "dk"), got, want, strict=True):
        assert a.shape == b.shape
        assert_bytes_equal(a.contiguous(), b.contiguous(), name)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("d", "b"), [(16, 3), (128, 1), (2, 2)])
def test_forward_and_backward_are_the_eager_bytes(dtype, d, b):
    _check_bytes(dtype, "cpu", d=d, b=b)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_table_not_only_one_whose_halves_repeat(dtype):
    """RotaryEmbedding's cos and sin repeat across the halves (cat(freqs, freqs)); the backward
    must still read the partner's sine, which a table with distinct halves tells apart."""
    q, k, cos, sin, gq, gk = _inputs(dtype)
    g = torch.Generator().manual_seed(7)
    cos, sin = (torch.rand(cos.shape, generator=g).mul(2).sub(1).to(dtype) for _ in range(2))
    got = _run(rope_train, q, k, cos, sin, gq, gk)
    want = _run(rope_reference, q, k, cos, sin, gq, gk)
    for name, a, b in zip(("q", "k", "dq", "dk"), got, want, strict=True):
        assert_bytes_equal(a.contiguous(), b.contiguous(), name)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_gradients_keep_their_signs(dtype):
    """Masked tokens' gradients are zeros of either sign: each term of dq is then a signed zero
    and their sum keeps eager's sign (-0 + -0 = -0, anything + +0 = +0)."""
    q, k, cos, sin, gq, gk = _inputs(dtype)
    signs = torch.where(torch.rand(gq.shape) < 0.5, -1.0, 1.0).to(dtype)
    gq, gk = gq * 0.0 * signs, gk * 0.0
    got = _run(rope_train, q, k, cos, sin, gq, gk)
    want = _run(rope_reference, q, k, cos, sin, gq, gk)
    assert (torch.signbit(want[2]) != torch.signbit(want[2][..., :1])).any(), "both signs occur"
    for name, a, b in zip(("q", "k", "dq", "dk"), got, want, strict=True):
        assert_bytes_equal(a.contiguous(), b.contiguous(), name)


@interpreter
def test_a_gradient_in_another_layout_is_read_as_its_values():
    """SDPA's backward may hand back a contiguous [B, N, S, D] gradient: copied to the kernel's
    layout, the same bytes."""
    q, k, cos, sin, gq, gk = _inputs(torch.float32)
    gq, gk = gq.contiguous(), gk.contiguous()
    assert not gq.transpose(1, 2).is_contiguous()
    got = _run(rope_train, q, k, cos, sin, gq, gk)
    want = _run(rope_reference, q, k, cos, sin, gq, gk)
    for name, a, b in zip(("q", "k", "dq", "dk"), got, want, strict=True):
        assert_bytes_equal(a.contiguous(), b.contiguous(), name)


def test_what_the_kernel_does_not_take_runs_the_reference():
    q, k, cos, sin, _, _ = _inputs(torch.float32)
    assert rope_train_fits(q, k, cos, sin)
    refused = {
        "float64": (q.double(), k.double(), cos.double(), sin.double()),
        "mixed dtypes": (q, k, cos.bfloat16(), sin.bfloat16()),
        "D not a power of two": _inputs(torch.float32, d=12)[:4],
        "batch rows not one stride apart": (q[:, :, :3], k[:, :, :3], cos[:, :3], sin[:, :3]),
        "last dim strided": (q[..., ::2], k[..., ::2], cos[..., ::2], sin[..., ::2]),
    }
    assert not rope_train_fits(q[0], k[0], cos[0], sin[0]), "3-D"
    assert not rope_train_fits(q[0], k, cos, sin), "3-D q beside 4-D k"
    # one batch row: its batch stride is never read, whatever it is
    one = [torch.as_strided(t[:1], t[:1].shape, (12345, *t.stride()[1:])) for t in (q, k)]
    assert rope_train_fits(*one, cos[:1], sin[:1])
    for what, args in refused.items():
        assert not rope_train_fits(*args), what
        want = rope_reference(*args)
        for a, b in zip(rope_train(*args), want, strict=True):  # no kernel: the reference
            assert_bytes_equal(a, b, what)


@interpreter
def test_apply_rope_runs_the_kernel_where_the_rowwise_kernels_are_triton(monkeypatch):
    import mxrl.kernels.rope_train as rt

    calls = []
    launch = rt._launch
    monkeypatch.setattr(rt, "_launch", lambda *a, **kw: calls.append(kw) or launch(*a, **kw))
    q, k, cos, sin, gq, gk = _inputs(torch.float32)
    rope = ApplyRope()
    assert rope.rowwise is Backend.REFERENCE
    want = _run(rope, q, k, cos, sin, gq, gk)
    assert calls == []
    rope.rowwise = Backend.TRITON
    got = _run(rope, q, k, cos, sin, gq, gk)
    assert calls == [{"backward": False}, {"backward": True}]
    for a, b in zip(got, want, strict=True):
        assert_bytes_equal(a.contiguous(), b.contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_eager_bytes(dtype):
    """The compiled kernel (no FMA contraction in fp32) at the model's head dim."""
    _check_bytes(dtype, "cuda", d=128, b=4, s=64, n=8, nk=2)


def test_the_launch_is_the_compiled_one_and_an_empty_batch_launches_nothing(monkeypatch):
    """The launcher asks for what test_rowwise_compile.py compiles and checks (no FMA
    contraction, one warp a head of 128), B x S programs; no launch for no tokens. A flat
    gradient is read in place, another layout copied once."""
    import mxrl.kernels.rope_train as rt
    import mxrl.kernels.triton_rowwise as rw

    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw))

    monkeypatch.setattr(rw, "rope_kernel", Kernel())
    for d, warps in ((128, 1), (256, 2)):
        q, k, cos, sin, _, _ = _inputs(torch.float32, d=d, b=2, s=3, n=4, nk=2)
        rt._launch(q, k, cos, sin, backward=True)
        grid, kw = launches.pop()
        assert grid == (2 * 3, 4 + 2)
        assert kw["enable_fp_fusion"] is False and kw["num_warps"] == warps
        assert kw["BACKWARD"] is True and kw["IS_BF16"] is False and kw["D"] == d
    q, k, cos, sin, _, _ = _inputs(torch.float32, s=0)
    oq, ok = rt._launch(q, k, cos, sin, backward=False)
    assert launches == [] and oq.shape == q.shape and ok.shape == k.shape
    g = _inputs(torch.float32)[4]  # [B, N, S, D] contiguous: not token-major
    flat = g.transpose(1, 2).contiguous().transpose(1, 2)
    assert rt._token_major(flat) is flat
    assert torch.equal(rt._token_major(g), g) and rt._token_major(g) is not g
