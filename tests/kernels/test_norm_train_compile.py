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

import pytest

from tests.kernels.compile_sm90 import ptx_counts, report_in_subprocess

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
    return {
        name: ptx_counts(fn, sig, constexprs, PATTERNS)
        for name, (fn, sig, constexprs) in variants.items()
    }


@pytest.fixture(scope="module")
def ptx_report():
    if not TRITON_IMPORTABLE:
        pytest.skip("needs triton (the sm_90 compiler)")
    return report_in_subprocess("tests.kernels.test_norm_train_compile", timeout=600)


def test_norm_kernels_compile_with_ieee_arithmetic(ptx_report):
    assert set(ptx_report) == {
        "fwd_bf16_fp32", "bwd_bf16", "sum_partials_bf16", "swiglu_fwd_bf16", "swiglu_bwd_bf16"
    }  # fmt: skip
    for name in ("fwd_bf16_fp32", "bwd_bf16", "sum_partials_bf16"):
        counts = ptx_report[name]
        assert counts["approx"] == 0 and counts["ftz"] == 0, (name, counts)
    # the forward: the engine's statistics (mean and 1/root divided, one square root)
    assert ptx_report["fwd_bf16_fp32"]["div_rn"] >= 2
    assert ptx_report["fwd_bf16_fp32"]["sqrt_rn"] == 1
    assert ptx_report["bwd_bf16"]["div_rn"] >= 1  # the mean of g w xhat


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
