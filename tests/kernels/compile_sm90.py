"""Compile the kernels for sm_90 without a GPU and report what the PTX holds.

Run as a script (in a process where TRITON_INTERPRET is unset, so triton.jit builds real
kernels): prints one JSON object {kernel name: {instruction class: count}}. Used by
test_compile_sm90.py; also handy by hand:

    python -m tests.kernels.compile_sm90
"""

from __future__ import annotations

import json
import os
import re

PATTERNS = {
    "cvt_e4m3_satfinite": r"cvt\.rn\.satfinite\.e4m3x2\.f32",
    "div_rn_f32": r"div\.rn\.f32",
    "div_approx": r"div\.(full|approx)",
    "rcp_approx": r"rcp\.approx",
    "ftz": r"\.ftz",
    "fma_f32": r"\bfma\.rn\.f32",
    "mul_rn_f32": r"\bmul\.rn\.f32",
}


def report_in_subprocess(module: str, timeout: int) -> dict:
    """Run `python -m module` with TRITON_INTERPRET unset (real sm_90 compiles, whatever this
    process has imported) and parse the JSON object it prints last."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", module],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def ptx_counts(
    fn, signature: dict, constexprs: dict, patterns: dict, *, options=None, attrs=None
) -> dict[str, int]:
    """Compile the Triton kernel `fn` for sm_90 (signature: {argument: type} of its runtime
    arguments, in any order) and count each pattern's matches in its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {**signature, **{k: "constexpr" for k in constexprs}}
    full = {n: full[n] for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=full, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    ptx = triton.compile(src, target=target, options=options or {"num_warps": 4}).asm["ptx"]
    return {key: len(re.findall(p, ptx)) for key, p in patterns.items()}


def _variants():
    from mxrl.kernels import triton_fp8_block as fb
    from mxrl.kernels import triton_mxfp8 as mx
    from mxrl.kernels import triton_nvfp4 as nv

    common = {"HW": True, "INDEX_64": False, "EVEN": True}
    mx_sig = ["x_ptr:*bf16", "q_row_ptr:*u8", "s_row_ptr:*u8", "q_col_ptr:*u8", "s_col_ptr:*u8"]
    mx_sig += ["sums_ptr:*fp32", "src_ptr:*i32"]
    nv_sig = ["x_ptr:*bf16", "amax_ptr:*fp32", "amax_stride:i32", "q_ptr:*u8", "s_ptr:*u8"]
    nv_sig += ["gs_ptr:*fp32", "sums_ptr:*fp32"]
    fb_sig = ["x_ptr:*bf16", "q_ptr:*u8", "s_ptr:*fp32", "sums_ptr:*fp32"]
    nv_const = {"PER_TOKEN": True, "WRITE_GS": 1, "ROWS": 1, "FOUR_OVER_SIX": False, **common}
    nv_const["SUMS"] = False
    mx_const = {"BLOCK_M": 32, "BLOCK_K": 256, "ROW_QDQ": False, "COL_QDQ": False, **common}
    mx_const |= {"SUMS": False, "GATHER": False}
    yield (
        "mxfp8_row_col",
        mx._mxfp8_kernel,
        [*mx_sig, "M:i32", "K:i32"],
        {"ROWWISE": True, "COLWISE": True, **mx_const},
        4,
    )
    # MXFP8's quantized backward: x's row-wise bf16 values and its padded column-wise codes
    padded = {**mx_const, "ROW_QDQ": True, "GATHER": True, "EVEN": False}
    yield (
        "mxfp8_padded_gather",
        mx._mxfp8_kernel,
        [mx_sig[0], "q_row_ptr:*bf16", *mx_sig[2:], "M:i32", "K:i32"],
        {"ROWWISE": True, "COLWISE": True, **padded},
        4,
    )
    yield (
        "nvfp4_per_token",
        nv._nvfp4_kernel,
        [*nv_sig, "M:i32", "K:i32"],
        {**nv_const, "SINGLE_TILE": True, "BLOCK_K": 8192},
        4,
    )
    yield (
        "nvfp4_two_pass",
        nv._nvfp4_kernel,
        [*nv_sig, "M:i32", "K:i32"],
        {**nv_const, "SINGLE_TILE": False, "BLOCK_K": 4096},
        4,
    )
    nv_46 = {**nv_const, "FOUR_OVER_SIX": True}
    yield (
        "nvfp4_4over6_per_token",
        nv._nvfp4_kernel,
        [*nv_sig, "M:i32", "K:i32"],
        {**nv_46, "SINGLE_TILE": True, "BLOCK_K": 8192},
        4,
    )
    yield (
        "nvfp4_4over6_two_pass",
        nv._nvfp4_kernel,
        [*nv_sig, "M:i32", "K:i32"],
        {**nv_46, "SINGLE_TILE": False, "BLOCK_K": 4096},
        4,
    )
    yield (
        "fp8_block_1x128",
        fb._fp8_block_1d_kernel,
        [*fb_sig, "M:i32", "K:i32"],
        {"UE8M0": False, "BK": 128, "ROWS": 16, "BLOCK_K": 512, "SUMS": False, **common},
        4,
    )
    yield (
        "fp8_block_128x128_ue8m0",
        fb._fp8_block_2d_kernel,
        [*fb_sig, "R:i32", "K:i32", "NUM_RB:i32"],
        {"UE8M0": True, "BK": 128, "SUMS": False, **common},
        8,
    )
    # the export's error sums (the SQNR's terms) beside the codes: SUMS_VARIANTS
    fp32 = "x_ptr:*fp32"
    yield (
        "sums_mxfp8_row",
        mx._mxfp8_kernel,
        [fp32, *mx_sig[1:], "M:i32", "K:i32"],
        {"ROWWISE": True, "COLWISE": False, **mx_const, "SUMS": True},
        4,
    )
    per_row = {**nv_const, "PER_TOKEN": False, "WRITE_GS": 0, "SUMS": True}
    for single, block_k, rows in ((True, 2048, 4), (False, 4096, 1)):
        yield (
            f"sums_nvfp4_{'single' if single else 'loop'}",
            nv._nvfp4_kernel,
            [fp32, *nv_sig[1:], "M:i32", "K:i32"],
            {**per_row, "SINGLE_TILE": single, "BLOCK_K": block_k, "ROWS": rows},
            4,
        )
    yield (
        "sums_fp8_block_1x128",
        fb._fp8_block_1d_kernel,
        [fp32, *fb_sig[1:], "M:i32", "K:i32"],
        {"UE8M0": False, "BK": 128, "ROWS": 16, "BLOCK_K": 512, "SUMS": True, **common},
        4,
    )
    yield (
        "sums_fp8_block_128x128",
        fb._fp8_block_2d_kernel,
        [fp32, *fb_sig[1:], "R:i32", "K:i32", "NUM_RB:i32"],
        {"UE8M0": False, "BK": 128, "SUMS": True, **common},
        8,
    )
    from mxrl.kernels import triton_kv_write as kvw

    kv_sig = ["x_ptr:*bf16", "stride_t:i32", "stride_h:i32", "slot_ptr:*i64", "q_ptr:*u8"]
    yield (
        "kv_write_fp8",
        kvw.kv_write_fp8_kernel,
        [*kv_sig, "s_ptr:*fp32", "N:i32"],
        {"HEADS": 4, "D": 128, "HW": True, "ROWS": kvw.ROWS},
        4,
    )


def compile_all() -> dict[str, dict[str, int]]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    report = {}
    for name, fn, args, constexprs, num_warps in _variants():
        signature = dict(a.split(":") for a in args)
        signature.update({k: "constexpr" for k in constexprs})
        names = [n for n in fn.arg_names if n in signature]
        signature = {n: signature[n] for n in names}
        aligned = {
            (names.index(n),): [["tt.divisibility", 16]]
            for n, t in signature.items()
            if t.startswith("*") or n in ("M", "K", "R")
        }
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
        ptx = triton.compile(src, target=target, options={"num_warps": num_warps}).asm["ptx"]
        report[name] = {key: len(re.findall(p, ptx)) for key, p in PATTERNS.items()}
    return report


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"
    print(json.dumps(compile_all()))
