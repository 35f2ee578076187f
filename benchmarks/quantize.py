"""Quantizer throughput on the GPU against the device's copy bandwidth and torchao.

For each Triton quantizer (mxfp8 row, mxfp8 row+col, nvfp4 per token, nvfp4 per tensor,
fp8_block 1x128 and 128x128) on one BF16 [M, K] input (default 16384 x 8192):
1. check that its bytes equal the reference's (`mxrl.formats.quantize` on the same GPU; the
   reference is device-invariant) -- abort if not;
2. time it (median, L2 flushed between runs) and report the bytes it must move (x read once;
   data, block scales and global scales written) per second, the ratio to `dst.copy_(x)` of a
   same-size tensor (bytes read + written) measured in this run, and the ratio to torchao's
   quantizer (torch.compile'd, or its Triton kernel for block FP8) where torchao is importable;
3. time the eager reference for context.
nvfp4 per tensor reads x twice (global amax, then quantize): its ceiling is below the copy's.

    python benchmarks/quantize.py [--out benchmarks/results/h200.json] [--shape 16384 8192]
                                  [--quick] [--sweep] [--no-torchao] [--no-reference]

--sweep also times a few launch configurations per kernel (each checked byte for byte) and
prints the fastest, to choose the DEFAULT_CONFIGs in mxrl/kernels/triton_*.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import (
    REPO_ROOT,
    TIMING,
    bench_ms,
    copy_bandwidth,
    ensure_repo_on_path,
    environment,
    format_table,
    gbps,
    update_results,
)

ensure_repo_on_path()

from mxrl.formats import quantize as reference_quantize  # noqa: E402

log = logging.getLogger("benchmarks.quantize")

Outputs = tuple[torch.Tensor, ...]


@dataclass
class Case:
    """One quantizer: our op, the reference producing the same tensors, bytes it must move."""

    name: str
    run: Callable[[torch.Tensor], Outputs]
    reference: Callable[[torch.Tensor], Outputs]
    num_bytes: int
    passes_over_input: int = 1
    launch: Callable[[torch.Tensor, dict], Outputs] | None = None  # for --sweep
    configs: list[dict] = field(default_factory=list)


def _u8(*tensors: torch.Tensor) -> Outputs:
    return tuple(t.contiguous().view(torch.uint8) for t in tensors)


def build_cases(m: int, k: int) -> list[Case]:
    from mxrl.kernels import ops
    from mxrl.kernels.triton_fp8_block import launch_fp8_block
    from mxrl.kernels.triton_mxfp8 import launch_mxfp8
    from mxrl.kernels.triton_nvfp4 import launch_nvfp4
    from mxrl.kernels.triton_nvfp4_scale import launch_global_amax

    mk, x_bytes = m * k, 2 * m * k

    def ref_mx_row(x):
        q = reference_quantize(x, "mxfp8")
        return _u8(q.qdata, q.scale)

    def ref_mx_both(x):
        return ref_mx_row(x) + _u8(*reference_quantize(x, "mxfp8", axis=0).tensors().values())

    def ref_nv(per_token):
        def ref(x):
            q = reference_quantize(x, "nvfp4", per_token=per_token)
            return _u8(q.qdata, q.scale, q.global_scale.reshape(-1))

        return ref

    def ref_fp8(block):
        def ref(x):
            q = reference_quantize(x, "fp8_block", block=block)
            return _u8(q.qdata, q.scale)

        return ref

    mx_configs = [
        {"BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 2},
        {"BLOCK_M": 32, "BLOCK_K": 256, "num_warps": 4},
        {"BLOCK_M": 32, "BLOCK_K": 256, "num_warps": 8},
        {"BLOCK_M": 32, "BLOCK_K": 512, "num_warps": 8},
        {"BLOCK_M": 64, "BLOCK_K": 256, "num_warps": 8},
    ]
    nv_configs = [
        {"TILE_ELEMS": 4096, "LOOP_BLOCK_K": 2048, "num_warps": 4},
        {"TILE_ELEMS": 8192, "num_warps": 4},
        {"TILE_ELEMS": 8192, "num_warps": 8},
        {"TILE_ELEMS": 16384, "num_warps": 8},
    ]
    fp8_1d_configs = [
        {"ROWS": 4, "BLOCK_K": 1024, "num_warps": 4},
        {"ROWS": 8, "BLOCK_K": 512, "num_warps": 4},
        {"ROWS": 16, "BLOCK_K": 512, "num_warps": 4},
        {"ROWS": 16, "BLOCK_K": 1024, "num_warps": 8},
        {"ROWS": 32, "BLOCK_K": 256, "num_warps": 4},
    ]
    fp8_2d_configs = [{"num_warps_2d": w} for w in (4, 8, 16)]

    def nv_launch(per_token):
        def launch(x, cfg):
            amax = None if per_token else launch_global_amax(x)
            q, s, gs = launch_nvfp4(x, amax, config=cfg)
            return _u8(q, s, gs.reshape(-1))

        return launch

    def fp8_launch(block):
        def launch(x, cfg):
            q, sf = launch_fp8_block(x.view(1, m, k), block, False, config=cfg)
            return _u8(q[0], sf[0])

        return launch

    return [
        Case(
            "mxfp8_row",
            lambda x: _u8(*ops.quantize_mxfp8(x, True, False)[:2]),
            ref_mx_row,
            x_bytes + mk + mk // 32,
            launch=lambda x, cfg: _u8(*launch_mxfp8(x, True, False, config=cfg)[:2]),
            configs=mx_configs,
        ),
        Case(
            "mxfp8_row_col",
            lambda x: _u8(*ops.quantize_mxfp8(x, True, True)),
            ref_mx_both,
            x_bytes + 2 * (mk + mk // 32),
            launch=lambda x, cfg: _u8(*launch_mxfp8(x, True, True, config=cfg)),
            configs=mx_configs,
        ),
        Case(
            "nvfp4_per_token",
            lambda x: _nv_op(ops, x, True),
            ref_nv(True),
            x_bytes + mk // 2 + mk // 16 + 4 * m,
            launch=nv_launch(True),
            configs=nv_configs,
        ),
        Case(
            "nvfp4_per_tensor",
            lambda x: _nv_op(ops, x, False),
            ref_nv(False),
            x_bytes + mk // 2 + mk // 16 + 4,
            passes_over_input=2,
            launch=nv_launch(False),
            configs=nv_configs,
        ),
        Case(
            "fp8_block_1x128",
            lambda x: _u8(*ops.quantize_fp8_block(x, 1, 128, False)),
            ref_fp8((1, 128)),
            x_bytes + mk + 4 * (mk // 128),
            launch=fp8_launch((1, 128)),
            configs=fp8_1d_configs,
        ),
        Case(
            "fp8_block_128x128",
            lambda x: _u8(*ops.quantize_fp8_block(x, 128, 128, False)),
            ref_fp8((128, 128)),
            x_bytes + mk + 4 * (-(-m // 128)) * (k // 128),
            launch=fp8_launch((128, 128)),
            configs=fp8_2d_configs,
        ),
    ]


def _nv_op(ops, x: torch.Tensor, per_token: bool) -> Outputs:
    q, s, gs = ops.quantize_nvfp4(x, None, per_token)
    return _u8(q, s, gs.reshape(-1))


# --- torchao baselines -----------------------------------------------------------------------


def torchao_baselines() -> tuple[dict[str, tuple[str, Callable]], str | None, str | None]:
    """{case name: (what is timed, fn(x))}, torchao version, why absent (None if present)."""
    try:
        import torchao
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            nvfp4_quantize,
            per_tensor_amax_to_scale,
        )
    except Exception as err:  # missing, or an API this script does not know
        return {}, None, f"torchao not importable: {type(err).__name__}: {err}"

    rceil = ScaleCalculationMode.RCEIL

    def mx_row(x):
        return to_mx(x, torch.float8_e4m3fn, 32, rceil)

    def mx_both(x):
        return to_mx(x, torch.float8_e4m3fn, 32, rceil), to_mx(
            x.t().contiguous(), torch.float8_e4m3fn, 32, rceil
        )

    def nv_tensor(x):
        return nvfp4_quantize(x, 16, per_tensor_amax_to_scale(torch.max(torch.abs(x))))

    def nv_token(x):
        return nvfp4_quantize(x, 16, per_tensor_amax_to_scale(x.abs().amax(-1, keepdim=True)))

    compile_ = torch.compile
    out = {
        "mxfp8_row": ("compile(to_mx RCEIL)", compile_(mx_row)),
        "mxfp8_row_col": ("compile(to_mx(x), to_mx(x.t())) RCEIL", compile_(mx_both)),
        "nvfp4_per_tensor": ("compile(amax + nvfp4_quantize)", compile_(nv_tensor)),
        "nvfp4_per_token": ("compile(row amax + nvfp4_quantize, [M,1] scale)", compile_(nv_token)),
    }
    try:
        from torchao.prototype.blockwise_fp8_training import kernels as bk

        out["fp8_block_1x128"] = (
            "triton_fp8_blockwise_act_quant_lhs (col-major scales)",
            lambda x: bk.triton_fp8_blockwise_act_quant_lhs(x, 128),
        )
        out["fp8_block_128x128"] = (
            "triton_fp8_blockwise_weight_quant_rhs (col-major output)",
            lambda x: bk.triton_fp8_blockwise_weight_quant_rhs(x, 128),
        )
    except Exception as err:
        log.warning("torchao block-FP8 kernels not importable: %s", err)
    return out, torchao.__version__, None


# --- main ------------------------------------------------------------------------------------


def check_exact(name: str, got: Outputs, want: Outputs) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.shape != w.shape or not torch.equal(g, w):
            n = (g != w).sum().item() if g.shape == w.shape else "shape"
            raise SystemExit(
                f"ABORT: {name} output {i} is not byte-exact with the reference "
                f"({n} bytes differ, shapes {tuple(g.shape)} vs {tuple(w.shape)}); "
                "run `pytest -m gpu tests/kernels` to find the input class that breaks it"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/h200.json")
    parser.add_argument("--shape", type=int, nargs=2, default=(16384, 8192), metavar=("M", "K"))
    parser.add_argument("--quick", action="store_true", help="fewer timed runs")
    parser.add_argument("--sweep", action="store_true", help="time alternative launch configs")
    parser.add_argument("--no-torchao", action="store_true", help="skip the torchao baselines")
    parser.add_argument("--no-reference", action="store_true", help="skip the eager reference")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/quantize.py needs a CUDA device")

    m, k = args.shape
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(0)).mul_(4.0)
    x = x.to(torch.bfloat16).cuda()
    env = environment()
    copy = copy_bandwidth(x, quick=args.quick)
    log.info(
        "%s: copy %.0f GB/s (%d MB read + written)",
        env["device"],
        copy["gbps"],
        copy["bytes"] >> 20,
    )

    if args.no_torchao:
        baselines, torchao_version, torchao_missing = {}, None, "skipped (--no-torchao)"
    else:
        baselines, torchao_version, torchao_missing = torchao_baselines()
    if torchao_missing:
        log.info("torchao baselines: %s -> ratio_to_torchao is null", torchao_missing)

    rows = []
    for case in build_cases(m, k):
        want = case.reference(x)
        check_exact(case.name, case.run(x), want)
        ms = bench_ms(lambda c=case: c.run(x), quick=args.quick)
        timing = TIMING["method"]
        ms_eager = bench_ms(lambda c=case: c.run(x), quick=args.quick, graph=False)
        row = {
            "kernel": case.name,
            "shape": [m, k],
            "dtype": "bfloat16",
            "exact": True,
            "bytes": case.num_bytes,
            "passes_over_input": case.passes_over_input,
            "ms": ms,
            "gbps": gbps(case.num_bytes, ms),
            "timing": timing,
            "ms_eager_launch": ms_eager,  # with Python launch overhead, for context
        }
        row["ratio_to_copy"] = row["gbps"] / copy["gbps"]
        row.update(_torchao_row(case, x, ms, ms_eager, baselines, torchao_missing, args.quick))
        if not args.no_reference:
            ref_ms = bench_ms(lambda c=case: c.reference(x), quick=True)
            row["reference_ms"], row["speedup_vs_reference"] = ref_ms, ref_ms / ms
        if args.sweep and case.launch is not None:
            row["sweep"] = _sweep(case, x, want, args.quick)
        rows.append(row)
        del want
        torch.cuda.empty_cache()

    columns = [
        ("kernel", "kernel", "s"),
        ("ms", "ms", ".3f"),
        ("gbps", "GB/s", ".0f"),
        ("ratio_to_copy", "x copy", ".2f"),
        ("torchao_gbps", "torchao GB/s", ".0f"),
        ("ratio_to_torchao", "x torchao", ".2f"),
        ("ms_eager_launch", "eager ms", ".3f"),
        ("reference_ms", "reference ms", ".2f"),
    ]
    print(f"\n{env['device']}  torch {env['torch']}  triton {env['triton']}  input {m}x{k} bf16")
    print(f"copy bandwidth (dst.copy_(x), read + write): {copy['gbps']:.0f} GB/s\n")
    print(format_table(rows, columns))
    if torchao_missing:
        print(f"\ntorchao: {torchao_missing}")
    for row in rows:
        if "sweep" in row:
            best = max(row["sweep"], key=lambda r: r["gbps"])
            print(f"sweep {row['kernel']}: best {best['config']} at {best['gbps']:.0f} GB/s")

    metadata = {**env, "torchao": torchao_version, "copy_gbps": copy["gbps"]}
    update_results(args.out, "quantize", rows, metadata)
    print(f"\nwrote {args.out}")
    return 0


def _torchao_row(case, x, ms, ms_eager, baselines, missing, quick) -> dict:
    """torchao's time for the same work; the ratio compares like with like: if torchao's
    function cannot be captured in a CUDA graph, both sides are timed eagerly."""
    if case.name not in baselines:
        note = missing or "no torchao counterpart timed"
        return {
            "torchao_variant": None,
            "torchao_ms": None,
            "torchao_gbps": None,
            "ratio_to_torchao": None,
            "torchao_note": note,
        }
    variant, fn = baselines[case.name]
    try:
        fn(x)  # compile outside the timing
        ao_ms = bench_ms(lambda: fn(x), quick=quick)
        ao_timing = TIMING["method"]
    except Exception as err:  # a baseline that fails must not stop the benchmark
        log.warning("torchao %s failed: %s", variant, err)
        return {
            "torchao_variant": variant,
            "torchao_ms": None,
            "torchao_gbps": None,
            "ratio_to_torchao": None,
            "torchao_note": f"failed: {type(err).__name__}: {err}",
        }
    return {
        "torchao_variant": variant,
        "torchao_ms": ao_ms,
        "torchao_gbps": gbps(case.num_bytes, ao_ms),  # same bytes, so the ratio is ao_ms / ms
        "torchao_timing": ao_timing,
        "ratio_to_torchao": ao_ms / (ms if ao_timing == "cuda_graph" else ms_eager),
        "torchao_note": None
        if ao_timing == "cuda_graph"
        else ("torchao timed eagerly (CUDA-graph capture failed); ratio against our eager time"),
    }


def _sweep(case: Case, x: torch.Tensor, want: Outputs, quick: bool) -> list[dict]:
    results = []
    for cfg in case.configs:
        check_exact(f"{case.name} {cfg}", case.launch(x, cfg), want)
        ms = bench_ms(lambda c=cfg: case.launch(x, c), quick=quick)
        results.append({"config": cfg, "ms": ms, "gbps": gbps(case.num_bytes, ms)})
    return results


if __name__ == "__main__":
    sys.exit(main())
