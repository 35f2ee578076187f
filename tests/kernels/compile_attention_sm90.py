"""Compile the paged attention's FP8-cache path for sm_90 without a GPU and count, in its PTX,
the hardware E4M3 conversions (`HW`) against the integer decode (the interpreter's path); and
its MLA shape (keys 192 wide padded to 256, values 128), which must compile. Run as
`python -m tests.kernels.compile_attention_sm90` with TRITON_INTERPRET unset; prints one JSON
object {variant: {pattern: count}}. Used by test_compile_sm90.py."""

from __future__ import annotations

import json
import os

PATTERNS = {
    "cvt_from_e4m3": r"cvt\.rn\.f16x2\.e4m3x2",
    "shl_b32": r"\bshl\.b32",
}


def compile_attention() -> dict[str, dict[str, int]]:
    from mxrl.kernels.triton_attention import paged_attention_kernel
    from tests.kernels.compile_sm90 import ptx_counts

    pointers = {"q_ptr": "*bf16", "k_cache_ptr": "*u8", "v_cache_ptr": "*u8",
                "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "o_ptr": "*bf16",
                "block_tables_ptr": "*i32", "tile_token_ptr": "*i32", "tile_rows_ptr": "*i32",
                "tile_pos_ptr": "*i32", "tile_req_ptr": "*i32"}  # fmt: skip
    strides = [n for n in paged_attention_kernel.arg_names if n.startswith("stride_")]
    signature = {**pointers, **dict.fromkeys(strides, "i32"), "scale": "fp32"}
    shape = {"G": 8, "DK": 128, "DV": 128, "BLOCK_DK": 128, "BLOCK_DV": 128, "BLOCK_M": 16,
             "BLOCK_N": 16, "IEEE": False, "FP8": True, "HEADS_KV": 4}  # fmt: skip
    report = {
        f"fp8_hw_{hw}": ptx_counts(paged_attention_kernel, signature, {**shape, "HW": hw}, PATTERNS)
        for hw in (True, False)
    }
    # DeepSeek-V3's MLA: 128 heads of keys 192 wide (padded to 256 in the kernel), values 128
    mla = {**shape, "G": 1, "DK": 192, "BLOCK_DK": 256, "FP8": False, "HEADS_KV": 128, "HW": True}
    bf16_cache = {**signature, "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16"}
    report["mla_bf16"] = ptx_counts(paged_attention_kernel, bf16_cache, mla, PATTERNS)
    return report


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"
    print(json.dumps(compile_attention()))
