"""The FP8 KV cache's fused write (mxrl.kernels.kv_write) under Triton's interpreter: a cache
written by it holds the bytes of the reference write (`quantize_kv`, then the codes and scales
copied to their slots), compared as uint8, slots the step did not write included; special
values (zeros, subnormals, the largest bf16, ±Inf, NaN) and a head dim outside the kernel's
blocks (the reference path). The GPU tier's engine tests run it on CUDA."""

from __future__ import annotations

import pytest
import torch

from mxrl.engine.kv_cache import KVCache
from mxrl.kernels.backend import Backend
from mxrl.kernels.kv_write import fused_write_fits, write_kv_fp8
from tests.kernels.test_decode_gemm import interpreter

SPECIAL = [0.0, -0.0, 1e-40, -3e-39, 3.3895e38, -3.3895e38, float("inf"), float("-inf"),
           float("nan"), 1e-4, 448.0, -449.0]  # fmt: skip


def step_kv(heads: int, tokens: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [K, T, D] bf16 as the engine hands them over (heads first), with special values
    in some vectors and one all-zero vector."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(heads, tokens, d, generator=gen) * 3
    v = torch.randn(heads, tokens, d, generator=gen) * 1e-3
    special = torch.tensor(SPECIAL)
    k[0, 0, : len(SPECIAL)] = special
    v[-1, -1, -len(SPECIAL) :] = special
    k[-1, 1] = 0.0
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


def caches(d: int, heads: int = 2, device: str = "cpu") -> tuple[KVCache, KVCache]:
    def make(backend):
        return KVCache(2, 6, 4, heads, d, torch.bfloat16, torch.device(device), fp8=True,
                       backend=backend)  # fmt: skip

    return make(Backend.REFERENCE), make(Backend.TRITON)


def assert_same_cache(a: KVCache, b: KVCache) -> None:
    for name in ("k", "v", "k_scale", "v_scale"):
        for layer, (x, y) in enumerate(zip(getattr(a, name), getattr(b, name), strict=True)):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (name, layer)


@interpreter
@pytest.mark.parametrize("d", [64, 128])
def test_the_fused_write_stores_the_reference_bytes(d, monkeypatch):
    from mxrl.kernels import triton_kv_write

    launches, launch = [], triton_kv_write.launch_kv_write_fp8
    monkeypatch.setattr(
        triton_kv_write, "launch_kv_write_fp8", lambda *a: launches.append(a) or launch(*a)
    )
    ref, fused = caches(d)
    slots = torch.tensor([17, 3, 22, 0, 9], dtype=torch.int64)  # any order, any block
    k, v = step_kv(2, 5, d, seed=d)
    x_TKD = k.transpose(0, 1)
    assert fused_write_fits(x_TKD, Backend.TRITON) and not fused_write_fits(x_TKD, "reference")
    fused.write(1, slots, k, v)
    assert len(launches) == 2  # one for the keys, one for the values
    ref.write(1, slots, k, v)
    assert_same_cache(ref, fused)
    written = fused.k_scale[1].view(-1, 2)
    assert (written[slots] > 0).all()  # every written vector has its scale (1e-4 / 448 at 0)
    untouched = [s for s in range(24) if s not in slots.tolist()]
    assert (written[untouched] == 0).all() and (fused.k[0] == 0).all()
    # a second step overwrites some slots and adds others, in another layer too
    k2, v2 = step_kv(2, 3, d, seed=d + 1)
    more = torch.tensor([3, 23, 4], dtype=torch.int64)
    for cache in (ref, fused):
        cache.write(1, more, k2, v2)
        cache.write(0, more, k2, v2)
    assert_same_cache(ref, fused)


@interpreter
def test_a_head_dim_outside_the_kernels_blocks_takes_the_reference_path():
    ref, fused = caches(48)
    k, v = step_kv(2, 3, 48, seed=5)
    assert not fused_write_fits(k.transpose(0, 1), Backend.TRITON)
    slots = torch.tensor([5, 6, 7], dtype=torch.int64)
    ref.write(0, slots, k, v)
    fused.write(0, slots, k, v)
    assert_same_cache(ref, fused)


@interpreter
def test_a_layer_that_does_not_fit_is_refused():
    _, fused = caches(64)
    k, _ = step_kv(2, 3, 64, seed=1)
    codes, scales = fused.k[0].view(-1, 2, 64), fused.k_scale[0].view(-1, 2)
    with pytest.raises(ValueError, match="do not fit the cache layer"):
        write_kv_fp8(k.transpose(0, 1), torch.tensor([0, 1]), codes, scales)  # 2 slots, 3 tokens
    with pytest.raises(ValueError, match="do not fit the cache layer"):
        write_kv_fp8(k.transpose(0, 1), torch.tensor([0, 1, 2]), codes, scales.double())


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_on_cuda_the_fused_write_stores_the_reference_bytes(d):
    """The kernel's hardware E4M3 conversion against the reference quantizer's, on a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ref, fused = caches(d, heads=4, device="cuda")
    k, v = (t.cuda() for t in step_kv(4, 7, d, seed=d))
    slots = torch.tensor([17, 3, 22, 0, 9, 23, 12], dtype=torch.int64, device="cuda")
    for cache in (ref, fused):
        cache.write(1, slots, k, v)
        cache.write(0, slots[:3], k[:, :3], v[:, :3])
    assert_same_cache(ref, fused)
