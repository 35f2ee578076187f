"""Dequantize-to-bf16 throughput on the GPU: `mxrl.kernels.dequantize` (one Triton pass) against
the reference `mxrl.formats.dequantize(q).to(bfloat16)` (fp32 tensor, then a cast) and the copy
bandwidth, in one run; and bf16 -> fp32 `to_float32` against torch's `.to(float32)`.

The training step writes these bf16 operands from the packed weights and activations per GEMM
(`mxrl.nn.weight.QWeight.operand`), so their speed is part of every low-precision step.
For each layout (mxfp8 row-wise and column-wise, nvfp4 with its per-expert global scale,
fp8_block 128x128) of one [E, N, K] expert weight (default Qwen3-30B-A3B's gate_up of one layer:
128 x 1536 x 2048): check the kernel's bytes equal the reference's (NaN-free input), then time
both (median) and report GB/s of bytes moved (packed bytes + scales read, bf16 written) and the
ratio to `dst.copy_(src)` of the same size measured here.

    python benchmarks/dequantize.py [--shape 128 1536 2048] [--out benchmarks/results/h200.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import (
    REPO_ROOT,
    bench_ms,
    copy_bandwidth,
    ensure_repo_on_path,
    environment,
    format_table,
    gbps,
    update_results,
)

ensure_repo_on_path()

from mxrl.formats import dequantize as reference_dequantize  # noqa: E402
from mxrl.formats import quantize  # noqa: E402
from mxrl.kernels import dequantize, to_float32  # noqa: E402


def layouts(w: torch.Tensor) -> dict:
    amax = w.abs().amax(dim=(1, 2), keepdim=True).float()
    return {
        "mxfp8 row-wise": (quantize(w, "mxfp8"), True),
        "mxfp8 column-wise": (quantize(w, "mxfp8", axis=1), True),
        "nvfp4 per expert, global scale": (quantize(w, "nvfp4", global_amax=amax), True),
        "nvfp4 per expert, lp (no global)": (quantize(w, "nvfp4", global_amax=amax), False),
        "fp8_block 128x128": (quantize(w, "fp8_block", block=(128, 128)), True),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[128, 1536, 2048])
    ap.add_argument("--out", help="results JSON (default benchmarks/results/h200.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/dequantize.py measures the GPU kernels: it needs CUDA")
    w = torch.randn(*args.shape, device="cuda", dtype=torch.bfloat16)
    copy = copy_bandwidth(w)
    rows = []
    for name, (q, global_scale) in layouts(w).items():
        got = dequantize(q, global_scale=global_scale)
        want = reference_dequantize(q, global_scale=global_scale).to(torch.bfloat16)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            raise SystemExit(f"{name}: the kernel's bytes differ from the reference's")
        moved = q.nbytes + got.numel() * 2
        ms = bench_ms(lambda q=q, g=global_scale: dequantize(q, global_scale=g))
        ref_ms = bench_ms(
            lambda q=q, g=global_scale: reference_dequantize(q, global_scale=g).to(torch.bfloat16)
        )
        rows.append({"layout": name, "ms": ms, "gbps": gbps(moved, ms), "reference_ms": ref_ms})
    moved = w.numel() * 6
    rows.append(
        {
            "layout": "bf16 -> fp32 (to_float32)",
            "ms": bench_ms(lambda: to_float32(w)),
            "reference_ms": bench_ms(lambda: w.to(torch.float32)),
        }
    )
    rows[-1]["gbps"] = gbps(moved, rows[-1]["ms"])
    for r in rows:
        r["x_copy"] = r["gbps"] / copy["gbps"]
        r["x_reference"] = r["reference_ms"] / r["ms"]
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s; weight {tuple(args.shape)}")
    print(format_table(rows, [
        ("layout", "layout", ""), ("ms", "ms", ".3f"), ("gbps", "GB/s", ".0f"),
        ("x_copy", "x copy", ".2f"), ("reference_ms", "reference ms", ".3f"),
        ("x_reference", "x faster", ".1f"),
    ]))  # fmt: skip
    out = Path(args.out) if args.out else REPO_ROOT / "benchmarks/results/h200.json"
    section = {"shape": args.shape, "copy_gbps": copy["gbps"], "rows": rows}
    update_results(out, "dequantize", {**section, "environment": environment()}, {})
    print(f"wrote the dequantize section of {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
