"""The dequantize kernels (mxrl/kernels/triton_dequant.py, and the MXFP8 quantizer's one-pass
quantize -> bf16 mode) compile for sm_90 on the CPU, and their
PTX holds what their bit-exactness relies on: the bf16 store is the round-to-nearest-even cvt
(what torch's CUDA `.to(bfloat16)` runs), nothing flushes to zero (E4M3 subnormals times tiny
scales stay subnormal), and no FMA (each element is a chain of exact or once-rounded products).
Catches what the interpreter does not see (a NaN constexpr shared by two jit functions fails
only in a real compile). Run by hand: `python -m tests.kernels.test_dequantize_compile`."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.kernels.compile_sm90 import ptx_counts, report_in_subprocess

TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.triton

PATTERNS = {
    "cvt_bf16": r"cvt\.rn\.bf16(x2)?\.f32",
    "ftz": r"\.ftz",
    "fma": r"\bfma\.rn\.f32",
    "mul": r"\bmul(\.rn)?\.f32",  # without .rn it may fuse into a later add: there is none
}
LAYOUTS = {  # name: (FMT, SR, SK, HAS_G, BLOCK_M, BLOCK_K, scale type)
    "mxfp8_row": (0, 1, 32, False, 16, 512, "*u8"),
    "mxfp8_col": (0, 32, 1, False, 32, 256, "*u8"),
    "nvfp4_global": (1, 1, 16, True, 16, 512, "*u8"),
    "fp8_block_128x128": (2, 128, 128, False, 128, 128, "*fp32"),
}


def compile_all() -> dict[str, dict[str, int]]:
    from mxrl.kernels import triton_dequant as td

    report = {}
    for name, (fmt, sr, sk, has_g, bm, bk, s_type) in LAYOUTS.items():
        sig = {"q_ptr": "*u8", "s_ptr": s_type, "g_ptr": "*fp32", "out_ptr": "*bf16",
               "M": "i32", "K": "i32"}  # fmt: skip
        constexprs = {"FMT": fmt, "SR": sr, "SK": sk, "HAS_G": has_g, "HW": True,
                      "BLOCK_M": bm, "BLOCK_K": bk}  # fmt: skip
        report[name] = ptx_counts(td._dequant_kernel, sig, constexprs, PATTERNS)
    from mxrl.kernels import triton_mxfp8 as mx

    mx_sig = {"x_ptr": "*bf16", "q_row_ptr": "*bf16", "s_row_ptr": "*u8", "q_col_ptr": "*bf16",
              "s_col_ptr": "*u8", "sums_ptr": "*fp32", "src_ptr": "*i32", "M": "i32",
              "K": "i32"}  # fmt: skip
    mx_const = {"ROWWISE": True, "COLWISE": True, "HW": True, "INDEX_64": False, "EVEN": True,
                "BLOCK_M": 32, "BLOCK_K": 256, "ROW_QDQ": True, "COL_QDQ": True, "SUMS": False,
                "GATHER": False}  # fmt: skip
    report["qdq_mxfp8"] = ptx_counts(mx._mxfp8_kernel, mx_sig, mx_const, PATTERNS)
    # the quantized backward's dy: row-wise bf16 at x's rows, column-wise bf16 of the padding
    gather = {**mx_const, "GATHER": True, "EVEN": False}
    report["qdq_mxfp8_padded"] = ptx_counts(mx._mxfp8_kernel, mx_sig, gather, PATTERNS)
    widen = {"src_ptr": "*i16", "dst_ptr": "*i32", "N": "i32"}
    report["widen_bf16"] = ptx_counts(td._widen_bf16_kernel, widen, {"BLOCK": 4096}, PATTERNS)
    scale = {"y_ptr": "*i16", "s_ptr": "*fp32", "out_ptr": "*bf16", "total": "i64", "N": "i32",
             "s_row": "i32", "s_col": "i32"}  # fmt: skip
    const = {"HW": True, "BLOCK": 4096}
    report["scale_bf16"] = ptx_counts(td._scale_bf16_kernel, scale, const, PATTERNS)
    return report


@pytest.fixture(scope="module")
def ptx_report():
    if not TRITON_IMPORTABLE:
        pytest.skip("needs triton (the sm_90 compiler)")
    return report_in_subprocess("tests.kernels.test_dequantize_compile", timeout=600)


def test_dequantize_kernels_compile_with_exact_arithmetic(ptx_report):
    assert set(ptx_report) == {
        *LAYOUTS,
        "widen_bf16",
        "qdq_mxfp8",
        "qdq_mxfp8_padded",
        "scale_bf16",
    }
    for name in [*LAYOUTS, "qdq_mxfp8", "qdq_mxfp8_padded", "scale_bf16"]:
        counts = ptx_report[name]
        assert counts["cvt_bf16"] > 0, (name, counts)
        assert counts["ftz"] == 0 and counts["fma"] == 0, (name, counts)
    assert ptx_report["widen_bf16"]["cvt_bf16"] == 0  # a shift of the bits, no conversion
    assert ptx_report["scale_bf16"]["mul"] > 0  # one product (no fma, above) before the cvt


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"
    print(json.dumps(compile_all()))
