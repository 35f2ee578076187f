"""The decode step's new kernels — the fused row-wise ops (mxrl/kernels/triton_rowwise.py: RMSNorm,
the experts' combine and grouping, RoPE, the router's softmax top-k) and the
grouped block-FP8 GEMM (triton_fp8_block_gemm.py) — compile for sm_90 on the CPU, and the row-wise
ones' PTX holds what rowwise.py's bounds rely on: IEEE division and square root (no approximate
div, rcp or sqrt), nothing flushed to zero, no FMA contraction in the combine's rounding chain.
Run by hand: `python -m tests.kernels.test_rowwise_compile` (one JSON line)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.kernels.compile_sm90 import ptx_counts, report_in_subprocess

TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.triton

PATTERNS = {
    "mma": r"\b(mma\.sync|wgmma\.mma_async)",
    "mma_e4m3": r"\b(mma\.sync|wgmma\.mma_async)\S*\.e4m3\.e4m3",
    "cvt_e4m3": r"cvt\.rn\.f16x2\.e4m3x2",
    "div_rn": r"div\.rn\.f32",
    "sqrt_rn": r"sqrt\.rn\.f32",
    "approx": r"(div|rcp|sqrt|rsqrt)\.(full|approx)",
    "ftz": r"\.ftz",
    "fma": r"\bfma\.rn\.f32",
    "add_zero": r"\badd\.rn\.f32\s+[^;]*0f00000000",  # x + 0: -0 -> +0
    "ld_b8": r"ld\.global(\.\w+)*\.b8",
    "cp_async": r"cp\.async\.\w+\.shared\.global",
}


def compile_all() -> dict[str, dict[str, int]]:
    from mxrl.kernels import triton_fp8_block_gemm as fb
    from mxrl.kernels import triton_moe_train as mt
    from mxrl.kernels import triton_rowwise as rw
    from mxrl.kernels import triton_sampling as ts

    variants = {
        "rms_norm_bf16": (
            rw.rms_norm_kernel,
            {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32",
             "stride_o": "i32", "H": "i32", "eps": "fp32"},
            {"BLOCK": 2048, "IS_BF16": True},
        ),
        "moe_combine_bf16": (
            rw.moe_combine_kernel,
            {"h_ptr": "*bf16", "w_ptr": "*bf16", "row_of_ptr": "*i64", "out_ptr": "*bf16",
             "stride_h": "i32", "stride_o": "i32", "H": "i32"},
            {"K": 8, "BLOCK": 1024, "IS_BF16": True},
        ),
        "moe_group": (
            rw.moe_group_kernel,
            {"ids_ptr": "*i64", "offsets_ptr": "*i32", "order_ptr": "*i64",
             "token_of_ptr": "*i64", "rows_ptr": "*i64", "T": "i32"},
            {"K": 8, "BLOCK_T": 64, "BLOCK_K": 8},
        ),
        "rope_bf16": (
            rw.rope_kernel,
            {"q_ptr": "*bf16", "k_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
             "q_out_ptr": "*bf16", "k_out_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32",
             "stride_kt": "i32", "stride_kh": "i32", "stride_ct": "i32", "stride_st": "i32",
             "N": "i32", "NK": "i32"},
            {"D": 128, "IS_BF16": True, "BACKWARD": False},
        ),
        **{
            f"rope_train_fp32{suffix}": (
                rw.rope_kernel,
                {"q_ptr": "*fp32", "k_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                 "q_out_ptr": "*fp32", "k_out_ptr": "*fp32", "stride_qt": "i32",
                 "stride_qh": "i32", "stride_kt": "i32", "stride_kh": "i32", "stride_ct": "i32",
                 "stride_st": "i32", "N": "i32", "NK": "i32"},
                {"D": 128, "IS_BF16": False, "BACKWARD": backward},
            )
            for suffix, backward in (("", False), ("_backward", True))
        },
        # the trainer's MoE permutation (mxrl.kernels.moe_train)
        "moe_unpermute": (
            mt.unpermute_kernel,
            {"h_ptr": "*bf16", "w_ptr": "*bf16", "inv_ptr": "*i64", "out_ptr": "*bf16",
             "stride_h": "i32", "stride_o": "i32", "H": "i32"},
            {"K": 8, "BLOCK": 1024},
        ),
        "moe_unpermute_backward": (
            mt.unpermute_backward_kernel,
            {"g_ptr": "*bf16", "h_ptr": "*bf16", "w_ptr": "*bf16", "inv_ptr": "*i64",
             "gh_ptr": "*bf16", "gw_ptr": "*bf16", "stride_g": "i32", "stride_h": "i32",
             "stride_gh": "i32", "H": "i32"},
            {"K": 8, "BLOCK": 2048},
        ),
        "moe_permute_backward": (
            mt.permute_backward_kernel,
            {"g_ptr": "*bf16", "inv_ptr": "*i64", "out_ptr": "*fp32", "stride_g": "i32",
             "stride_o": "i32", "H": "i32"},
            {"K": 8, "BLOCK": 1024, "OUT_BF16": False},
        ),
        "moe_route_bf16": (
            rw.moe_route_kernel,
            {"logits_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*bf16", "stride_l": "i32",
             "E": "i32"},
            {"K": 8, "NORM": True, "BLOCK": 128, "IS_BF16": True},
        ),
        **{
            f"fp8_block_grouped_bf16{suffix}": (
                fb.fp8_block_grouped_kernel,
                {"xq_ptr": "*u8", "xs_ptr": "*fp32", "wq_ptr": "*u8", "ws_ptr": "*fp32",
                 "offs_ptr": "*i32", "y_ptr": "*bf16", "xq_stride": "i32", "xs_stride": "i32",
                 "wq_stride_e": "i32", "wq_stride": "i32", "wq_stride_k": "i32",
                 "ws_stride_e": "i32", "ws_stride": "i32", "ws_stride_k": "i32",
                 "y_stride": "i32", "N": "i32", "K": "i32", "E": "i32"},
                {"HW": True, "OUT_BF16": True, "E_POW2": 128, "BLOCK_M": bm, "BLOCK_N": 64,
                 "FP8_MMA": fp8},
            )
            for suffix, bm, fp8 in (("", 16, False), ("_fp8", 64, True))
        },
        **{
            f"fp8_block_kgrouped{suffix}": (
                fb.fp8_block_kgrouped_kernel,
                {"aq_ptr": "*u8", "as_ptr": "*fp32", "bq_ptr": "*u8", "bs_ptr": "*fp32",
                 "offs_ptr": "*i32", "y_ptr": "*fp32", "aq_stride": "i32", "as_stride": "i32",
                 "bq_stride": "i32", "bs_stride": "i32", "y_stride_e": "i32",
                 "y_stride": "i32", "N": "i32", "K": "i32", "E": "i32", "E_PER_GROUP": "i32"},
                {"HW": True, "BLOCK_N": 128, "BLOCK_K": 128, "FP8_MMA": fp8, "E_POW2": 128},
            )
            for suffix, fp8 in (("", False), ("_fp8", True))
        },
        "sample_race_fp32": (
            ts.sample_race_kernel,
            {"logits_ptr": "*fp32", "temp_ptr": "*fp32", "greedy_ptr": "*i8",
             "seeds_ptr": "*i64", "counters_ptr": "*i64", "max_ptr": "*fp32",
             "sum_ptr": "*fp32", "lse_ptr": "*fp32", "score_ptr": "*fp32", "best_ptr": "*i32",
             "stride_l": "i32", "V": "i32", "S": "i32"},
            {"BLOCK": 2048, "S_POW2": 16},
        ),
        "sample_partials_fp32": (
            ts.sample_partials_kernel,
            {"logits_ptr": "*fp32", "temp_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32",
             "stride_l": "i32", "V": "i32", "S": "i32"},
            {"BLOCK": 2048},
        ),
        "sample_pick_fp32": (
            ts.sample_pick_kernel,
            {"logits_ptr": "*fp32", "temp_ptr": "*fp32", "lse_ptr": "*fp32", "score_ptr": "*fp32",
             "best_ptr": "*i32", "token_ptr": "*i64", "logp_ptr": "*fp32", "stride_l": "i32",
             "S": "i32"},
            {"S_POW2": 1},
        ),
    }  # fmt: skip
    return {
        name: ptx_counts(
            fn, sig, constexprs, PATTERNS, attrs=_aligned(fn, name), options=_opts(name)
        )
        for name, (fn, sig, constexprs) in variants.items()
    }


# what the launcher's arguments give Triton at run time: 16-byte aligned pointers and strides
# (torch's allocations; token counts padded to 128), as its argument specialization sees them
ALIGNED = {
    "fp8_block_kgrouped": (
        "aq_ptr", "as_ptr", "bq_ptr", "bs_ptr", "offs_ptr", "y_ptr", "aq_stride", "bq_stride",
        "y_stride_e", "y_stride", "N", "K",
    ),
}  # fmt: skip


def _aligned(fn, name: str):
    names = next((v for k, v in ALIGNED.items() if name.startswith(k)), ())
    return {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in names} or None


def _opts(name: str) -> dict:
    if name.startswith("rope_train"):  # the trainer's launch (mxrl.kernels.rope_train)
        return {"num_warps": 1, "enable_fp_fusion": False}
    if name.startswith(("moe_unpermute", "moe_permute")):  # mxrl.kernels.moe_train's launches
        return {"num_warps": 4, "enable_fp_fusion": False}
    return {"num_warps": 8, "num_stages": 3} if name.startswith("fp8_block_kgrouped") else None


@pytest.fixture(scope="module")
def ptx_report():
    if not TRITON_IMPORTABLE:
        pytest.skip("needs triton (the sm_90 compiler)")
    return report_in_subprocess("tests.kernels.test_rowwise_compile", timeout=600)


def test_rowwise_kernels_compile_with_ieee_arithmetic(ptx_report):
    assert set(ptx_report) == {
        "rms_norm_bf16", "moe_combine_bf16", "fp8_block_grouped_bf16", "sample_race_fp32",
        "sample_partials_fp32", "sample_pick_fp32", "fp8_block_kgrouped",
        "fp8_block_grouped_bf16_fp8", "fp8_block_kgrouped_fp8",
        "moe_group", "rope_bf16", "moe_route_bf16", "rope_train_fp32", "rope_train_fp32_backward",
        "moe_unpermute", "moe_unpermute_backward", "moe_permute_backward",
    }  # fmt: skip
    for name in ("rms_norm_bf16", "moe_combine_bf16", "fp8_block_grouped_bf16", "moe_route_bf16"):
        counts = ptx_report[name]
        assert counts["approx"] == 0 and counts["ftz"] == 0, (name, counts)
    # the combine rounds every product before its sum (the eager loop's bytes): no contraction;
    # RMSNorm's sum of squares may contract (its order is fixed either way, within the bound)
    assert ptx_report["moe_combine_bf16"]["fma"] == 0
    assert ptx_report["rope_bf16"]["fma"] == 0  # RoPE rounds both products before their sum
    # the trainer's fp32 RoPE: no contraction of a product and the sum (the eager bytes)
    assert (
        ptx_report["rope_train_fp32"]["fma"] == ptx_report["rope_train_fp32_backward"]["fma"] == 0
    )
    # the trainer's MoE permutation: every product rounded before its sum, no flush to zero
    for name in ("moe_unpermute", "moe_unpermute_backward", "moe_permute_backward"):
        counts = ptx_report[name]
        assert counts["fma"] == 0 and counts["ftz"] == 0 and counts["approx"] == 0, (name, counts)
    # the combine's backward keeps its + 0 (autograd's index_add into zeros: -0 -> +0), which
    # an optimizer assuming no signed zeros would drop
    assert ptx_report["moe_unpermute_backward"]["add_zero"] >= 1
    assert ptx_report["rms_norm_bf16"]["div_rn"] >= 2
    assert ptx_report["rms_norm_bf16"]["sqrt_rn"] == 1
    # the router's weights: one IEEE division (its bound counts exp as ex2.approx, nothing else)
    assert ptx_report["moe_route_bf16"]["div_rn"] >= 1
    # the sampler divides by the temperature (and the race by the noise) as the torch sampler
    # does: IEEE divisions, none approximate (its exp and log are the GPU's, as documented)
    for name in ("sample_partials_fp32", "sample_race_fp32", "sample_pick_fp32"):
        counts = ptx_report[name]
        assert counts["approx"] == 0 and counts["div_rn"] >= 1, (name, counts)
    assert ptx_report["sample_race_fp32"]["div_rn"] >= 2  # logit / T and p / E


def test_grouped_block_fp8_runs_on_tensor_cores(ptx_report):
    """The E4M3 codes decode with the hardware cvt and the inner sums are MMAs (the forward and
    the experts' weight gradient)."""
    for name in ("fp8_block_grouped_bf16", "fp8_block_kgrouped"):
        counts = ptx_report[name]
        assert counts["cvt_e4m3"] > 0 and counts["mma"] > 0, (name, counts)
        assert counts["mma_e4m3"] == 0, (name, counts)


def test_grouped_block_fp8_wgrad_loads_its_codes_as_vectors(ptx_report):
    """With the launcher's aligned arguments the wgrad's code tiles stream through cp.async
    (16-byte, pipelined), not byte by byte: a loop from a loaded bound loaded them with 128
    byte loads and ran at 62 TFLOP/s on the H200 (docs/kernels.md)."""
    for name in ("fp8_block_kgrouped", "fp8_block_kgrouped_fp8"):
        counts = ptx_report[name]
        assert counts["ld_b8"] == 0 and counts["cp_async"] > 0, (name, counts)


def test_grouped_block_fp8_runs_on_fp8_tensor_cores_when_asked(ptx_report):
    """fp8_mma=True: the codes go to the FP8 MMA as they are (no decode to fp16)."""
    for name in ("fp8_block_grouped_bf16_fp8", "fp8_block_kgrouped_fp8"):
        counts = ptx_report[name]
        assert counts["mma_e4m3"] > 0 and counts["cvt_e4m3"] == 0, (name, counts)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"
    print(json.dumps(compile_all()))
