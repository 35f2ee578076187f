"""The kernels compile for sm_90 (no GPU needed: Triton lowers to PTX on the CPU) and the PTX
holds what the bit-exactness argument relies on (mxrl/kernels/triton_codecs.py): the satfinite
E4M3 cvt, IEEE `div.rn.f32` for every division, no approximate division or reciprocal, no
flush-to-zero. Skipped without triton (CI)."""

from __future__ import annotations

import pytest

from tests.kernels.compile_sm90 import report_in_subprocess
from tests.kernels.conftest import TRITON_IMPORTABLE

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not TRITON_IMPORTABLE, reason="needs triton")]


@pytest.fixture(scope="module")
def ptx_report() -> dict:
    return report_in_subprocess("tests.kernels.compile_sm90", timeout=600)


def test_every_kernel_compiles_for_sm90(ptx_report):
    assert set(ptx_report) == {
        "mxfp8_row_col",
        "mxfp8_padded_gather",
        "nvfp4_per_token",
        "nvfp4_two_pass",
        "nvfp4_4over6_per_token",
        "nvfp4_4over6_two_pass",
        "fp8_block_1x128",
        "fp8_block_128x128_ue8m0",
        "kv_write_fp8",
        "sums_mxfp8_row",
        "sums_nvfp4_single",
        "sums_nvfp4_loop",
        "sums_fp8_block_1x128",
        "sums_fp8_block_128x128",
    }


def test_e4m3_is_the_satfinite_cvt(ptx_report):
    for name, counts in ptx_report.items():
        assert counts["cvt_e4m3_satfinite"] > 0, name


def test_divisions_are_ieee_and_nothing_flushes(ptx_report):
    for name, counts in ptx_report.items():
        assert counts["div_approx"] == 0, name
        assert counts["rcp_approx"] == 0, name
        assert counts["ftz"] == 0, name
    for name in ("nvfp4_per_token", "nvfp4_two_pass", "fp8_block_1x128", "kv_write_fp8"):
        assert ptx_report[name]["div_rn_f32"] > 0, name


def test_fma_only_where_exact(ptx_report):
    """Only e2m1_encode may contract (its product is exact): no FMA elsewhere. The variants
    with the error sums (`sums_*`) may contract them: they are the SQNR's terms, which the
    reference computes in float64 (a relative 1e-6 apart, `mxrl.kernels.api.error_sums`);
    their codes and scales are the same instructions' (test_interpreter compares the bytes)."""
    for name, counts in ptx_report.items():
        if not name.startswith(("nvfp4", "sums_")):
            assert counts["fma_f32"] == 0, name


def test_4over6_contracts_only_exact_products(ptx_report):
    """NVFP4 4over6: per element, the standard kernel has one FMA (e2m1_encode's exact product);
    4over6 has four (two e2m1_encode, two `e2m1 * s - u`, whose product is exact too) and three
    `mul.rn.f32` (u = x * S_enc and the two squares, which must not contract)."""
    for standard, four in (
        ("nvfp4_per_token", "nvfp4_4over6_per_token"),
        ("nvfp4_two_pass", "nvfp4_4over6_two_pass"),
    ):
        per_element = ptx_report[standard]["fma_f32"]
        assert per_element > 0 and ptx_report[standard]["mul_rn_f32"] == 0
        assert ptx_report[four]["fma_f32"] == 4 * per_element, four
        assert ptx_report[four]["mul_rn_f32"] == 3 * per_element, four


def test_the_fp8_cache_attention_decodes_e4m3_in_hardware():
    """On a GPU the paged attention reads an FP8 cache through the E4M3 cvt instruction, not
    the interpreter's integer decode (which costs ~15 integer operations an element)."""
    report = report_in_subprocess("tests.kernels.compile_attention_sm90", timeout=600)
    assert report["fp8_hw_True"]["cvt_from_e4m3"] > 0
    assert report["fp8_hw_False"]["cvt_from_e4m3"] == 0
    assert report["fp8_hw_True"]["shl_b32"] < report["fp8_hw_False"]["shl_b32"]
    assert report["mla_bf16"]["cvt_from_e4m3"] == 0  # compiled: a bf16 cache, nothing to decode
