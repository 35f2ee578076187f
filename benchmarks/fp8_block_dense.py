"""A block-FP8 dense projection at the engine's tile (128 rows) on CUDA, per GEMM the engine
could run (docs/benchmarks.md, "Rollout"): the routed experts' grouped Triton kernel as one
group, `fp8_block_matmul` (torch._scaled_mm blockwise: what `RolloutLinear` runs on CUDA), the
fp32 GEMM on the dequantized weight (the engine's path before block-FP8 weights stayed packed),
bf16 for scale, and the 1x128 activation quantizer. Microseconds per call, from replays of a
CUDA graph of 20 calls; the shapes are Qwen3-30B-A3B's attention projections.

    python benchmarks/fp8_block_dense.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mxrl.formats import QTensor, dequantize
from mxrl.kernels import quantize
from mxrl.kernels.fp8_gemm import fp8_block_matmul, grouped_fp8_block_matmul

SHAPES = [(4096, 2048), (512, 2048), (2048, 4096)]  # q, k / v, o: [N, K]
TILE = 128


def time_us(fn: Callable[[], object], calls: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls // 20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1000


def one_shape(n: int, k: int, m: int = TILE) -> str:
    w = torch.randn(n, k, device="cuda") * 0.02
    wq = quantize(w, "fp8_block", block=(128, 128), backend="triton")
    w3 = QTensor(wq.qdata[None], wq.scale[None], wq.fmt, (1, n, k))
    w_deq, w_bf16 = dequantize(wq), w.to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq = quantize(x, "fp8_block", block=(1, 128), backend="triton")
    offsets = torch.tensor([0, m], device="cuda", dtype=torch.int32)
    bf16 = torch.bfloat16
    t = {
        "triton-grouped": time_us(lambda: grouped_fp8_block_matmul(xq, w3, offsets, out_dtype=bf16)),
        "scaled_mm": time_us(lambda: fp8_block_matmul(xq, wq, out_dtype=bf16)),
        "fp32 emulated": time_us(lambda: F.linear(x.float(), w_deq)),
        "bf16": time_us(lambda: F.linear(x, w_bf16)),
        "act quantize": time_us(lambda: quantize(x, "fp8_block", block=(1, 128), backend="triton")),
    }  # fmt: skip
    a = grouped_fp8_block_matmul(xq, w3, offsets, out_dtype=torch.float32)
    b = fp8_block_matmul(xq, wq, out_dtype=torch.float32)
    times = ", ".join(f"{name} {us:.1f} us" for name, us in t.items())
    return f"N={n} K={k} M={m}: {times}; max |triton - scaled_mm| {(a - b).abs().max().item():.3e}"


def main() -> None:
    for n, k in SHAPES:
        print(one_shape(n, k), flush=True)


if __name__ == "__main__":
    main()
