"""Block-FP8 GEMM (torch._scaled_mm, 1x128 activations x 128x128 weights) against cuBLAS BF16
at training shapes, on one CUDA device. Prints TFLOP/s and the speedup over BF16 measured in the
same run, and writes the `fp8_block_gemm` section of benchmarks/results/h200.json.

    python benchmarks/fp8_block_gemm.py [--out benchmarks/results/h200.json] [--quick]

Rows: the GEMM alone on pre-quantized operands, and the GEMM plus the activation's 1x128
quantization (the Triton kernel; the weight is quantized once per optimizer step and not
counted). Every row first checks the GEMM against the emulated fp32 GEMM of the same QTensors.
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import (
    REPO_ROOT,
    TIMING,
    bench_ms,
    ensure_repo_on_path,
    environment,
    format_table,
    update_results,
)

ensure_repo_on_path()

from mxrl.formats import dequantize  # noqa: E402
from mxrl.kernels import quantize  # noqa: E402
from mxrl.kernels.fp8_gemm import fp8_block_matmul  # noqa: E402

# (M tokens, N, K): Qwen3-30B-A3B projections at 8k-16k tokens per step, and a square one.
SHAPES = [
    (8192, 4096, 2048),  # q_proj (32 heads x 128)
    (8192, 2048, 4096),  # o_proj
    (16384, 1536, 2048),  # one expert's gate+up at 16k routed tokens (2 x 768)
    (16384, 2048, 768),  # one expert's down
    (8192, 8192, 8192),  # square
]


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=str, default=str(REPO_ROOT / "benchmarks/results/h200.json"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device (sm_90 for block-FP8 _scaled_mm)", file=sys.stderr)
        return 2
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        xq = quantize(x, "fp8_block", block=(1, 128))
        wq = quantize(w, "fp8_block", block=(128, 128))
        y = fp8_block_matmul(xq, wq, out_dtype=torch.float32)
        ref = dequantize(xq) @ dequantize(wq).t()
        rel = float((y - ref).abs().max() / ref.abs().max())
        if rel > 2e-3:  # the bound tests/kernels/test_fp8_gemm.py states
            raise SystemExit(f"fp8 GEMM disagrees with the emulated GEMM at {(m, n, k)}: {rel}")
        del y, ref
        bf16_ms = bench_ms(lambda x=x, w=w: x @ w.t(), quick=args.quick)
        fp8_ms = bench_ms(lambda xq=xq, wq=wq: fp8_block_matmul(xq, wq), quick=args.quick)
        with_q_ms = bench_ms(
            lambda x=x, wq=wq: fp8_block_matmul(quantize(x, "fp8_block", block=(1, 128)), wq),
            quick=args.quick,
        )
        rows.append(
            {
                "M": m,
                "N": n,
                "K": k,
                "bf16_tflops": tflops(m, n, k, bf16_ms),
                "fp8_tflops": tflops(m, n, k, fp8_ms),
                "speedup_vs_bf16": bf16_ms / fp8_ms,
                "fp8_with_act_quant_tflops": tflops(m, n, k, with_q_ms),
                "speedup_with_act_quant": bf16_ms / with_q_ms,
                "max_rel_err_vs_emulated_fp32": rel,
                "timing": TIMING["method"],
            }
        )
        torch.cuda.empty_cache()
    env = environment()
    print(f"{env['device']}  torch {env['torch']}  block-FP8 (1x128 x 128x128) vs BF16\n")
    print(
        format_table(
            rows,
            [
                ("M", "M", "d"),
                ("N", "N", "d"),
                ("K", "K", "d"),
                ("bf16_tflops", "BF16 TFLOP/s", ".0f"),
                ("fp8_tflops", "FP8 TFLOP/s", ".0f"),
                ("speedup_vs_bf16", "x BF16", ".2f"),
                ("fp8_with_act_quant_tflops", "FP8+quant TFLOP/s", ".0f"),
                ("speedup_with_act_quant", "x BF16", ".2f"),
            ],
        )
    )
    from pathlib import Path

    update_results(Path(args.out), "fp8_block_gemm", rows, env)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
