"""The engine's dense projections, tiles against one launch (CUDA, sm90+): invariance, bytes, time.

    python benchmarks/dense_gemm.py

In the batch-invariant mode the engine runs every dense projection on 128-row tiles (one
cuBLAS launch each), so a prefill of 4,096 tokens is 32 launches per projection. For the
Qwen3-30B-A3B slice's shapes (q, k/v, o, the router; lm_head tiled only) this compares, per
projection, in bf16:
- the tiles (`F.linear` on 128-row slices, zero-padded: `mxrl.nn.paths.tiles.tiled`);
- one `torch._grouped_mm` launch with one group (the engine's `dense_gemm="grouped"`);
- `F.linear` over all rows (the engine's `batch_invariant=False`, time only);
and in block FP8 (the fp8-block preset's attention projections) `fp8_block_matmul` (cuBLAS's
blockwise `_scaled_mm`) on 128-row tiles against one call over all rows. For each one-launch
form: whether a row's bytes over T rows, T in `ROWS`, equal its bytes in the 8192-row call
(invariant; bf16 also with the rows of a 2048-row batch permuted), and whether they equal the
tiles' bytes. Wall time per call, host included (a prefill is launch-bound), at T = 128 (a
decode step) and 4096 (32 prompts of 128 tokens): the mean of 20 calls after a warm-up.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from common import ensure_repo_on_path

ensure_repo_on_path()

from mxrl.formats import QTensor  # noqa: E402
from mxrl.kernels.api import quantize  # noqa: E402
from mxrl.kernels.fp8_gemm import fp8_block_matmul  # noqa: E402
from mxrl.nn.paths.tiles import one_group as grouped  # noqa: E402
from mxrl.nn.paths.tiles import tiled as engine_tiled  # noqa: E402

TILE = 128
ROWS = [1, 3, 16, 100, 128, 129, 255, 256, 1000, 2048, 4096, 8192]
BF16 = {"q": (4096, 2048), "kv": (512, 2048), "o": (2048, 4096), "router": (128, 2048),
        "lm_head": (32000, 2048)}  # fmt: skip
FP8 = {"q": (4096, 2048), "kv": (512, 2048), "o": (2048, 4096)}


def tiled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The engine's tiles (`mxrl.nn.paths.tiles.tiled`): one `F.linear` per 128-row tile."""
    return engine_tiled(lambda c: F.linear(c, w), x, TILE)


def rows_of(q: QTensor, a: int, b: int) -> QTensor:
    return QTensor(q.qdata[a:b], q.scale[a:b], q.fmt, (b - a, q.shape[1]))


def fp8_tiled(xq: QTensor, wq: QTensor) -> torch.Tensor:
    m = xq.shape[0]
    return torch.cat([fp8_block_matmul(rows_of(xq, i, min(m, i + TILE)), wq)
                      for i in range(0, m, TILE)])  # fmt: skip


def wall_us(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def bf16_row(name: str, n: int, k: int) -> str:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    x = torch.randn(ROWS[-1], k, device="cuda", dtype=torch.bfloat16)
    one = name != "lm_head"  # N = 32000 is left to the tiles here
    full_t = tiled(x, w)
    inv_t = all(same(tiled(x[:t], w), full_t[:t]) for t in ROWS)
    row = [name, n, k, f"tiled {'' if inv_t else 'NOT '}invariant"]
    if one:
        full_g = grouped(x, w)
        inv_g = all(same(grouped(x[:t], w), full_g[:t]) for t in ROWS)
        perm = torch.randperm(2048, device="cuda")
        inv_g &= same(grouped(x[:2048][perm], w), full_g[:2048][perm])
        eq = all(same(grouped(x[:t], w), full_t[:t]) for t in ROWS)
        row[3:3] = [f"grouped {'' if inv_g else 'NOT '}invariant"]
        row.append("grouped==tiled bytes" if eq else "grouped!=tiled bytes")
    for t in (TILE, 4096):
        xt = x[:t]
        g = f" grouped {wall_us(lambda xt=xt: grouped(xt, w)):.0f}us" if one else ""
        row.append(f"T={t}: tiled {wall_us(lambda xt=xt: tiled(xt, w)):.0f}us{g} "
                   f"linear {wall_us(lambda xt=xt: F.linear(xt, w)):.0f}us")  # fmt: skip
    return " | ".join(map(str, row))


def fp8_row(name: str, n: int, k: int) -> str:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    wq = quantize(w, "fp8_block", block=(128, 128), backend="triton")
    x = torch.randn(ROWS[-1], k, device="cuda", dtype=torch.bfloat16)
    xq = quantize(x, "fp8_block", block=(1, 128), backend="triton")
    full = fp8_block_matmul(xq, wq)
    inv = all(same(fp8_block_matmul(rows_of(xq, 0, t), wq), full[:t]) for t in ROWS)
    eq = same(full, fp8_tiled(xq, wq))
    row = [f"fp8 {name}", n, k, f"one-call {'' if inv else 'NOT '}invariant",
           "one-call==tiles" if eq else "one-call!=tiles"]  # fmt: skip
    for t in (TILE, 4096):
        q = rows_of(xq, 0, t)
        row.append(f"T={t}: tiled {wall_us(lambda q=q: fp8_tiled(q, wq)):.0f}us "
                   f"one-call {wall_us(lambda q=q: fp8_block_matmul(q, wq)):.0f}us")  # fmt: skip
    return " | ".join(map(str, row))


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, (n, k) in BF16.items():
        print(bf16_row(name, n, k), flush=True)
    for name, (n, k) in FP8.items():
        print(fp8_row(name, n, k), flush=True)


if __name__ == "__main__":
    main()
