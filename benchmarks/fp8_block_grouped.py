"""The routed experts' block-FP8 training GEMMs at Qwen3-30B-A3B's width against the bf16 grouped
GEMMs our bf16 step runs (`torch._grouped_mm`, CUTLASS), per tile configuration: forward
(`grouped_fp8_block_matmul`), dgrad (the same kernel reading w transposed) and wgrad
(`grouped_fp8_block_wgrad`, grouped along the tokens, fp32 out), each with the fp16 MMA on
decoded codes and with the FP8 MMA. Milliseconds per call (CUDA events, median of 5 after 2
warm-ups) and TFLOP/s of the real (unpadded) work; 128 experts, top 8, T tokens.

    python benchmarks/fp8_block_grouped.py --tokens 4096
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics

import torch

from mxrl.kernels import quantize
from mxrl.kernels.fp8_gemm import grouped_fp8_block_matmul, grouped_fp8_block_wgrad

BF16 = torch.bfloat16
PROJECTIONS = {"gate_up": (1536, 2048), "down": (2048, 768)}  # [N, K] per expert


def time_ms(fn, repeats: int = 5) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def routing(tokens: int, experts: int, top_k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    counts = torch.bincount(ids.flatten(), minlength=experts)
    padded = (counts + 127) // 128 * 128
    ends = counts.cumsum(0)
    return ends.to(torch.int32), padded.cumsum(0).to(torch.int32)


CONFIGS = list(itertools.product((64, 128), (64, 128), (4, 8), (3, 4), (False, True)))


def one_projection(
    name: str, n: int, k: int, e: int, ends, padded_ends, gemms=("forward", "dgrad", "wgrad")
) -> list[dict]:
    offsets = torch.cat([ends.new_zeros(1), ends])
    p_offsets = torch.cat([ends.new_zeros(1), padded_ends])
    r, p = int(ends[-1]), int(padded_ends[-1])
    w = torch.randn(e, n, k, device="cuda") * 0.02
    x = torch.randn(r, k, device="cuda", dtype=BF16)
    dy = torch.randn(r, n, device="cuda", dtype=BF16)
    q = functools.partial(quantize, fmt="fp8_block", backend="triton")
    wq = q(w, block=(128, 128))
    xq, dyq = q(x, block=(1, 128)), q(dy, block=(1, 128))
    xtq = q(torch.randn(k, p, device="cuda", dtype=BF16), block=(1, 128))
    dytq = q(torch.randn(n, p, device="cuda", dtype=BF16), block=(1, 128))
    wb = w.to(BF16)
    gmm = torch._grouped_mm
    rows = [
        dict(gemm=g, impl="bf16 grouped_mm", ms=time_ms(functools.partial(gmm, a, b, offs=ends)))
        for g, a, b in (
            ("forward", x, wb.transpose(-2, -1)), ("dgrad", dy, wb), ("wgrad", dy.t(), x)
        )
    ]  # fmt: skip
    for bm, bn, warps, stages, fp8 in CONFIGS:
        tile = dict(num_warps=warps, num_stages=stages, fp8_mma=fp8)
        calls = {
            "forward": functools.partial(
                grouped_fp8_block_matmul, xq, wq, offsets, out_dtype=BF16, block_m=bm,
                block_n=bn, **tile,
            ),
            "dgrad": functools.partial(
                grouped_fp8_block_matmul, dyq, wq, offsets, out_dtype=BF16, block_m=bm,
                block_n=bn, transpose_w=True, **tile,
            ),
            "wgrad": functools.partial(
                grouped_fp8_block_wgrad, dytq, xtq, p_offsets, block_n=bm, block_k=bn, **tile
            ),
        }  # fmt: skip
        for gemm, call in calls.items():
            if gemm not in gemms:
                continue
            try:
                ms = time_ms(call)
            except Exception as err:  # a config that does not compile or fit
                ms = float("nan")
                print(f"  {name} {gemm} {bm}x{bn} {tile}: {type(err).__name__}")
            rows.append(dict(gemm=gemm, impl="fp8 triton", tile=[bm, bn], **tile, ms=ms))
    flop = 2 * r * n * k
    for row in rows:
        row.update(proj=name, tflops=flop / row["ms"] / 1e9)
    for gemm in gemms:
        mine = [x for x in rows if x["gemm"] == gemm and x["ms"] == x["ms"]]
        base = next(x for x in mine if x["impl"] == "bf16 grouped_mm")
        fast = min((x for x in mine if x["impl"] != "bf16 grouped_mm"), key=lambda x: x["ms"])
        cfg = {c: fast[c] for c in ("tile", "num_warps", "num_stages", "fp8_mma")}
        print(
            f"{name} {gemm}: bf16 grouped_mm {base['ms']:.3f} ms; best fp8 {fast['ms']:.3f} ms "
            f"({base['ms'] / fast['ms']:.2f}x, {fast['tflops']:.0f} TFLOP/s) {cfg}",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--gemms", nargs="+", default=["forward", "dgrad", "wgrad"])
    ap.add_argument("--out", help="write the rows as JSON")
    args = ap.parse_args(argv)
    ends, padded_ends = (t.cuda() for t in routing(args.tokens, args.experts, args.top_k))
    rows = []
    for name, (n, k) in PROJECTIONS.items():
        rows += one_projection(name, n, k, args.experts, ends, padded_ends, tuple(args.gemms))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tokens": args.tokens, "experts": args.experts, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
