"""The low-bit GEMM kernel compiles for sm_90 on the CPU (Triton lowers to PTX and runs ptxas
without a GPU), in the configurations `choose_config` picks for the benchmark shapes and the
ones the GPU tests use, and its PTX holds what triton_gemm.py's argument relies on:
- tensor-core MMAs (mma.sync for block_m <= 32, wgmma above) for the bf16 dot, none for "ieee"
  or the CUDA-core "fma" dot;
- the hardware E4M3 -> f16x2 cvt for decoding (MXFP8 bytes, NVFP4's E4M3 images);
- split-K: one acq_rel GPU-scope atomic per program after a CTA barrier, partials read with
  ld.global.cg (L2, not a possibly stale L1);
- no flush-to-zero, no approximate division or reciprocal; no register spills on the bf16 and fma
  paths.
Skipped without triton (CI). Run by hand: `python -m tests.kernels.test_decode_gemm_compile`
(prints one JSON line per variant: PTX instruction counts and the cubin's registers).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.kernels.compile_sm90 import report_in_subprocess

# not from conftest: importing it turns the interpreter on, and this module compiles for real
TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.triton

PATTERNS = {
    "wgmma": r"wgmma\.mma_async",
    "mma_sync": r"\bmma\.sync",
    "cvt_e4m3": r"cvt\.rn\.f16x2\.e4m3x2",
    "atom_acq_rel_gpu": r"atom\.global\.gpu\.acq_rel\.add",
    "ld_cg": r"ld\.global\.cg",
    "bar_sync": r"bar\.sync",
    "ftz": r"\.ftz",
    "div_approx": r"div\.(full|approx)",
    "rcp_approx": r"rcp\.approx",
}
_POINTERS = {
    "xq_ptr": "*u8",
    "xs_ptr": "*u8",
    "xgs_ptr": "*fp32",
    "wq_ptr": "*u8",
    "ws_ptr": "*u8",
    "wgs_ptr": "*fp32",
    "y_ptr": "*bf16",
    "part_ptr": "*fp32",
    "cnt_ptr": "*i32",
}
_ALIGNED_INTS = ("xq_stride", "xs_stride", "wq_stride_e", "wq_stride", "ws_stride_e", "ws_stride")
_ALIGNED_INTS += ("N", "K", "K_PER_SPLIT")


def variants():
    """(name, fmt code, grouped, GemmConfig, hw) for the benchmark's shapes and the tests'
    configs; hw False: the interpreter's code path, which the GPU tests also run compiled."""
    from mxrl.kernels.decode_gemm import GemmConfig, choose_config

    seen = set()
    for fmt_name, fmt in (("nvfp4", 1), ("mxfp8", 0)):
        for m in (1, 32, 128):
            for n, k, groups in ((4096, 2048, 1), (512, 2048, 1), (1536, 2048, 8)):
                cfg = choose_config(m, groups, n, k, 132, fmt_name)
                key = (fmt, groups > 1, cfg)
                if key not in seen:
                    seen.add(key)
                    yield f"{fmt_name}-m{m}-n{n}-g{groups}", fmt, groups > 1, cfg, True
        for bm, warps in ((16, 4), (64, 4), (128, 8)):
            yield f"{fmt_name}-bf16-bm{bm}", fmt, False, GemmConfig(bm, 64, 128, 4, warps, 2), True
            yield f"{fmt_name}-ieee-bm{bm}", fmt, False, GemmConfig.ieee(bm, 4), True
        for bm, bn, bk in ((1, 32, 128), (1, 64, 256), (8, 16, 128)):
            cfg = GemmConfig(bm, bn, bk, 4, 4, 3, dot="fma")
            yield f"{fmt_name}-fma-bm{bm}-bn{bn}-bk{bk}", fmt, True, cfg, True
        triton_ops = GemmConfig(16, 64, 128, 4, nvfp4_decode="triton")
        yield f"{fmt_name}-triton-decode", fmt, True, triton_ops, True
        yield f"{fmt_name}-interpreter-path", fmt, False, GemmConfig(16, 64, 128, 2), False


def compile_variant(fmt: int, grouped: bool, cfg, hw: bool = True):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mxrl.kernels import triton_gemm as tg

    fn = tg._low_bit_gemm_kernel
    constexprs = {
        "FMT": fmt,
        "GROUPED": grouped,
        "HAS_GS": fmt == 1,
        "HW": hw,
        "NV_ASM": hw and fmt == 1 and cfg.nvfp4_decode == "asm",
        "MX_BLOCK_DOT": fmt == 0 and 16 <= cfg.block_m <= 32 and cfg.dot != "fma",
        "DOT_IEEE": cfg.dot == "ieee",
        "DOT_FMA": cfg.dot == "fma",
        "EVEN_K": True,
        "MASK_N": False,
        "SPLIT_K": cfg.split_k,
        "REDUCE": True,
        "E_POW2": 128 if grouped else 16,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
    }
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "offs_ptr":
            signature[name] = "*i64" if grouped else "*u8"
        else:
            signature[name] = _POINTERS.get(name, "i32")
    names = list(signature)
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n, t in signature.items()
        if t.startswith("*") or n in _ALIGNED_INTS
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _resources(cubin: bytes) -> dict[str, int]:
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True)
    found = re.findall(r"(REG|STACK|LOCAL):(\d+)", out.stdout.decode())
    return {k.lower(): int(v) for k, v in found}


def report() -> dict[str, dict]:
    out = {}
    for name, fmt, grouped, cfg, hw in variants():
        kernel = compile_variant(fmt, grouped, cfg, hw)
        ptx = kernel.asm["ptx"]
        counts = {key: len(re.findall(p, ptx)) for key, p in PATTERNS.items()}
        counts.update(_resources(kernel.asm["cubin"]))
        counts.update(split_k=cfg.split_k, block_m=cfg.block_m, dot=cfg.dot, hw=hw)
        out[name] = counts
    return out


@pytest.fixture(scope="module")
def ptx_report() -> dict:
    if not TRITON_IMPORTABLE:
        pytest.skip("needs triton")
    return report_in_subprocess("tests.kernels.test_decode_gemm_compile", timeout=900)


def test_compiles_with_tensor_cores_where_asked(ptx_report):
    assert len(ptx_report) >= 10
    for name, c in ptx_report.items():
        mma = c["wgmma"] + c["mma_sync"]
        assert (mma > 0) == (c["dot"] == "bf16" and c["hw"]), (name, c)
        if c["dot"] == "bf16" and c["hw"] and c["block_m"] <= 32:
            assert c["mma_sync"] > 0, (name, c)


def test_decodes_with_the_hardware_cvt(ptx_report):
    """MXFP8 bytes and NVFP4's E4M3 images of E2M1 codes go through cvt.rn.f16x2.e4m3x2."""
    for name, c in ptx_report.items():
        assert (c["cvt_e4m3"] > 0) == c["hw"], (name, c)


def test_split_k_protocol(ptx_report):
    for name, c in ptx_report.items():
        if c["split_k"] > 1:
            assert c["atom_acq_rel_gpu"] == 1 and c["ld_cg"] > 0 and c["bar_sync"] > 0, name
        else:
            assert c["atom_acq_rel_gpu"] == 0, name


def test_no_ftz_no_approximations(ptx_report):
    for name, c in ptx_report.items():
        assert c["ftz"] == 0 and c["div_approx"] == 0 and c["rcp_approx"] == 0, (name, c)


def test_no_register_spills_on_the_tensor_core_and_fma_paths(ptx_report):
    for name, c in ptx_report.items():
        if "stack" in c and c["dot"] in ("bf16", "fma") and c["hw"]:
            assert c["local"] == 0 and c["stack"] == 0, (name, c)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"
    print(json.dumps(report()))
