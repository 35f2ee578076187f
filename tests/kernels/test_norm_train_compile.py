"""The trainer's fused RMSNorm kernels (mxrl/kernels/triton_norm.py) and the fused SwiGLU's
(triton_swiglu.py) compile for sm_90 on the CPU, and their PTX holds what norm_train.py's and
swiglu.py's bounds rely on: IEEE division and square root (no approximate div, rcp or sqrt),
nothing flushed to zero in the norms; SwiGLU's exp is libdevice's (its 2-ulp expf, not a bare
ex2).
Run by hand: `python -m tests.kernels.test_norm_train_compile` (one JSON line)."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

from tests.kernels.compile_sm90 import ptx_counts, report_in_subprocess

# (dtype, BLOCK, num_warps): the launches of Qwen3-30B-A3B's norms (hidden 2048, head dim 128)
# and of a row wider than 2048 (8 warps)
STATS_LAUNCHES = [("bf16", 2048, 4), ("fp32", 2048, 4), ("bf16", 128, 4), ("bf16", 4096, 8)]

TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.triton

PATTERNS = {
    "div_rn": r"div\.rn\.f32",
    "sqrt_rn": r"sqrt\.rn\.f32",
    "approx": r"(div|rcp|sqrt|rsqrt)\.(full|approx)",
    "ftz": r"\.ftz",
    "ex2": r"ex2\.approx",
    "fma": r"\bfma\.rn\.f32",
}


def compile_all() -> dict[str, dict[str, int]]:
    from mxrl.kernels import triton_norm as tn
    from mxrl.kernels import triton_swiglu as ts

    variants = {
        "fwd_bf16_fp32": (
            tn.rms_norm_fwd_kernel,
            {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "rstd_ptr": "*fp32",
             "stride_x": "i32", "stride_o": "i32", "H": "i32", "eps": "fp32"},
            {"BLOCK": 2048, "X_BF16": True, "OUT_BF16": False},
        ),
        "bwd_bf16": (
            tn.rms_norm_bwd_kernel,
            {"x_ptr": "*bf16", "w_ptr": "*bf16", "g_ptr": "*bf16", "rstd_ptr": "*fp32",
             "dx_ptr": "*bf16", "dw_part_ptr": "*fp32", "R": "i32", "H": "i32",
             "rows_per_program": "i32", "stride_x": "i32", "stride_g": "i32",
             "stride_dx": "i32"},
            {"BLOCK_R": 16, "BLOCK": 128, "X_BF16": True},
        ),
        "sum_partials_bf16": (
            tn.sum_partials_kernel,
            {"part_ptr": "*fp32", "out_ptr": "*bf16", "P": "i32", "H": "i32"},
            {"BLOCK": 1024, "OUT_BF16": True},
        ),
        "swiglu_fwd_bf16": (
            ts.silu_mul_fwd_kernel,
            {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32",
             "stride_gate": "i32", "stride_up": "i32", "stride_out": "i32"},
            {"BLOCK": 1024, "IS_BF16": True, "LIBDEVICE": True},
        ),
        "swiglu_bwd_bf16": (
            ts.silu_mul_bwd_kernel,
            {"dout_ptr": "*bf16", "gate_ptr": "*bf16", "up_ptr": "*bf16", "dgate_ptr": "*bf16",
             "dup_ptr": "*bf16", "N": "i32", "stride_dout": "i32", "stride_gate": "i32",
             "stride_up": "i32", "stride_dgate": "i32", "stride_dup": "i32"},
            {"BLOCK": 1024, "IS_BF16": True, "LIBDEVICE": True},
        ),
    }  # fmt: skip
    report = {
        name: ptx_counts(fn, sig, constexprs, PATTERNS)
        for name, (fn, sig, constexprs) in variants.items()
    }
    # per launch: how many operations the two kernels' statistics share (-1: they differ)
    report["stats_same_as_engine"] = {}
    for dt, block, warps in STATS_LAUNCHES:
        train = _statistics(dt, block, warps, train=True)
        same = train == _statistics(dt, block, warps, train=False)
        report["stats_same_as_engine"][f"{dt}_{block}_{warps}"] = len(train) if same else -1
    return report


def _statistics(dtype: str, block: int, warps: int, *, train: bool) -> list[str]:
    """The fp32 operations (and shuffles, shared-memory traffic) of the RMSNorm statistics up to
    the square root in the sm_90 PTX of the engine's kernel or the training forward, registers
    renamed in order of appearance: equal lists are the same sums in the same order."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mxrl.kernels import triton_norm as tn
    from mxrl.kernels import triton_rowwise as rw

    bf16 = dtype == "bf16"
    sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
           "stride_x": "i32", "stride_o": "i32", "H": "i32", "eps": "fp32"}  # fmt: skip
    if train:
        fn, consts = tn.rms_norm_fwd_kernel, {"BLOCK": block, "X_BF16": bf16, "OUT_BF16": bf16}
        sig["rstd_ptr"] = "*fp32"
    else:
        fn, consts = rw.rms_norm_kernel, {"BLOCK": block, "IS_BF16": bf16}
    full = {**sig, **{k: "constexpr" for k in consts}}
    src = ASTSource(fn=fn, signature={n: full[n] for n in fn.arg_names}, constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ops = []
    for line in ptx.asm["ptx"].splitlines():
        op = line.strip().split(" ")[0].split("\t")[0]
        kept = ".f32" in op or op.startswith(("shfl", "ld.shared", "st.shared"))
        if kept and not op.startswith("cvt"):
            ops.append(line.strip())
        if op.startswith("sqrt"):
            break
    names: dict[str, str] = {}
    rename = lambda m: names.setdefault(m.group(0), f"v{len(names)}")  # noqa: E731
    return [re.sub(r"%[a-z]+\d+", rename, line) for line in ops]


@pytest.fixture(scope="module")
def ptx_report():
    if not TRITON_IMPORTABLE:
        pytest.skip("needs triton (the sm_90 compiler)")
    return report_in_subprocess("tests.kernels.test_norm_train_compile", timeout=600)


def test_norm_kernels_compile_with_ieee_arithmetic(ptx_report):
    assert set(ptx_report) == {
        "fwd_bf16_fp32", "bwd_bf16", "sum_partials_bf16", "swiglu_fwd_bf16", "swiglu_bwd_bf16",
        "stats_same_as_engine",
    }  # fmt: skip
    for name in ("fwd_bf16_fp32", "bwd_bf16", "sum_partials_bf16"):
        counts = ptx_report[name]
        assert counts["approx"] == 0 and counts["ftz"] == 0, (name, counts)
    # the forward: the engine's statistics (mean and 1/root divided, one square root)
    assert ptx_report["fwd_bf16_fp32"]["div_rn"] >= 2
    assert ptx_report["fwd_bf16_fp32"]["sqrt_rn"] == 1
    assert ptx_report["bwd_bf16"]["div_rn"] >= 1  # the mean of g w xhat


def test_the_training_forward_compiles_the_engines_statistics(ptx_report):
    """Where x, w and out share a dtype, the training forward's sum of squares, mean and square
    root are the engine kernel's instructions in the same order (what gives the same bytes on
    the GPU; test_norm_train_gpu.py compares them)."""
    same = ptx_report["stats_same_as_engine"]
    # (at least the per-thread sums, the warp shuffles and the square root)
    assert len(same) == len(STATS_LAUNCHES) and all(n > 10 for n in same.values()), same


def test_swiglu_kernels_divide_exactly_around_libdevices_exp(ptx_report):
    """silu's and the sigmoid's IEEE divisions (torch's CUDA formulas); exp from libdevice's
    expf (an FMA range reduction around one ex2.approx), the function torch's silu calls."""
    for name in ("swiglu_fwd_bf16", "swiglu_bwd_bf16"):
        counts = ptx_report[name]
        assert counts["div_rn"] >= 1 and counts["ex2"] >= 1 and counts["fma"] >= 1, counts
        # Triton links libdevice with FTZ on: exp's range reduction flushes subnormal inputs
        # and results, where 1 + e^-x rounds to 1 either way; no approximate division
        assert counts["approx"] == 0, (name, counts)
    assert ptx_report["swiglu_bwd_bf16"]["div_rn"] >= 2  # silu (for dup) and the sigmoid


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"
    print(json.dumps(compile_all()))
