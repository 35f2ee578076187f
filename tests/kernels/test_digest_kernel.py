"""The checksum kernel (mxrl/kernels/triton_digest.py): under Triton's interpreter, the same
digest bytes as the PyTorch reference (`digest.field_digest_reference`) for every size class at
row and level boundaries, extreme bytes, unaligned and strided views and every dtype a weight
record stores; compiled for sm_90, full rows load as 16-byte cp.async and the sums run on int8
wgmma. The GPU run against the CPU reference is in tests/weights/test_digest.py.

By hand:
    python -m tests.kernels.test_digest_kernel           # the sm_90 PTX report (one JSON line)
    python -m tests.kernels.test_digest_kernel --bench [--sweep] [--gib 6.2]  # CUDA: GB/s
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys

import pytest
import torch

from mxrl.formats import quantize
from mxrl.weights import checksums
from tests.kernels.compile_sm90 import ptx_counts, report_in_subprocess
from tests.numerics import assert_bytes_equal

if __name__ == "__main__":  # the sm_90 report or the benchmark: no interpreter in this process
    INTERPRETER_READY = False
else:  # the kernels' conftest turns the interpreter on (CPU only) before triton is imported
    from tests.kernels.conftest import INTERPRETER_READY

digest = importlib.import_module("mxrl.kernels.digest")  # the module, not a function
ROW = digest.ROW_BYTES
TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None
_interpreter_ready = pytest.mark.skipif(
    not INTERPRETER_READY,
    reason="interpreter tests run without CUDA, with TRITON_INTERPRET=1 set before triton is "
    "imported (pytest tests/kernels, or TRITON_INTERPRET=1 pytest)",
)


def interpreter(fn):
    return pytest.mark.triton(_interpreter_ready(fn))


# Edge cases: (name, bytes). Levels: <= 2048 one, <= 32 rows two, <= 1024 rows three.
SIZES = [
    ("empty", 0),
    ("one byte", 1),
    ("row - 1", ROW - 1),
    ("one row", ROW),
    ("row + 1", ROW + 1),
    ("64 rows + 5", 64 * ROW + 5),
    ("32 rows: level 1 is one row", 32 * ROW),
    ("32 rows + 1: three levels", 32 * ROW + 1),
    ("1024 rows: three levels", 1024 * ROW),
    ("1024 rows + 1: four levels", 1024 * ROW + 1),
    ("3 MiB + 7", 3 * 2**20 + 7),
]
EXTREMES = [("all 0x80 (-128)", 0x80), ("all 0x7f (127)", 0x7F), ("all 0xff (-1)", 0xFF)]


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def reference(fields: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([digest.field_digest_reference(t) for t in fields])


def assert_digests_equal(fields: list[torch.Tensor], names: list[str]) -> None:
    got = digest.field_digests(fields, backend="triton")
    want = reference(fields)
    assert got.shape == want.shape == (64 * len(fields),)
    for i, name in enumerate(names):
        assert_bytes_equal(got[64 * i : 64 * (i + 1)], want[64 * i : 64 * (i + 1)], name)


@interpreter
def test_every_size_class_in_one_batch():
    """One call, every field at once (one launch per level): each digest the reference's."""
    fields = [random_bytes(n, seed=i) for i, (_, n) in enumerate(SIZES)]
    assert_digests_equal(fields, [name for name, _ in SIZES])


@interpreter
@pytest.mark.parametrize(("name", "n"), [s for s in SIZES if s[1] <= 64 * ROW + 5])
def test_one_field_alone(name, n):
    assert_digests_equal([random_bytes(n, seed=n)], [name])


@interpreter
def test_extreme_bytes_give_the_exact_sums():
    """|row sum| up to 128 * 2048 * 128 = 2^25: int32 exact, the reference's integers."""
    n = 40 * ROW + 17
    fields = [torch.full((n,), v, dtype=torch.uint8) for _, v in EXTREMES]
    assert_digests_equal(fields, [name for name, _ in EXTREMES])


@interpreter
def test_unaligned_and_strided_views_are_read_in_place():
    base = random_bytes(4 * ROW + 300, seed=7)
    wide = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    cases = {
        f"offset {k}": base[k : k + 3 * ROW + 123] for k in (1, 2, 3, 4, 8, 12)
    } | {
        "bf16 one element in": wide.reshape(-1)[1:],  # 2-byte aligned
        "transposed bf16": wide.t(),  # not contiguous: the reference's copy
        "aligned": base[16:],
    }  # fmt: skip
    assert_digests_equal(list(cases.values()), list(cases))


def _records() -> dict[str, torch.Tensor]:
    """Every dtype a weight record stores, from real quantizations (and the plain bf16)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 96, 256, generator=g)
    out = {"bf16": x.to(torch.bfloat16), "fp32": x[0, :5, :7]}
    for name, q in {
        "mxfp8": quantize(x, "mxfp8"),
        "nvfp4 per tensor": quantize(x, "nvfp4"),
        "nvfp4 per token": quantize(x, "nvfp4", per_token=True),
        "fp8_block": quantize(x, "fp8_block"),
    }.items():
        out |= {f"{name} {k}": t for k, t in q.tensors().items()}
    return out


@interpreter
def test_every_stored_dtype():
    fields = _records()
    dtypes = {t.dtype for t in fields.values()}
    assert {torch.uint8, torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.float32} <= dtypes
    assert any(t.dim() == 0 for t in fields.values())  # the per-tensor NVFP4 global scale
    assert_digests_equal(list(fields.values()), list(fields))


@interpreter
def test_checksums_on_the_triton_backend_equal_the_reference():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    values = [quantize(x, "nvfp4"), x.to(torch.bfloat16), quantize(x, "mxfp8"), random_bytes(9)]
    names = [f"t{i}" for i in range(len(values))]
    got = checksums(names, values, backend="triton")
    assert got == checksums(names, values, backend="reference")
    assert checksums([], [], backend="triton") == []


@pytest.mark.triton
def test_the_plan_has_the_reference_levels_and_refuses_too_large():
    """Host-side planning only (no triton kernels run): the number of levels per field is the
    reference loop's, and a field past MAX_LEVELS is refused as the reference refuses it."""
    if not TRITON_IMPORTABLE:
        pytest.skip("needs triton")
    from mxrl.kernels.triton_digest import _alignment, _plan

    sizes = [n for _, n in SIZES]
    levels, workspace = _plan(sizes)
    for f, n in enumerate(sizes):
        want = 1
        while digest.num_rows(n) > 1:
            n, want = digest.DIGEST_BYTES * digest.num_rows(n), want + 1
        assert sum(any(g == f for g, _ in level) for level in levels) == want, sizes[f]
    assert workspace == sum(64 * digest.num_rows(n) for level in levels for _, n in level) - sum(
        64 for _ in sizes
    )
    with pytest.raises(ValueError, match="too large"):
        _plan([ROW * 32**8])
    assert [_alignment(a) for a in (0, 1, 2, 6, 8, 24, 48, 4096)] == [16, 1, 2, 2, 8, 8, 16, 16]


# --- sm_90 compile ------------------------------------------------------------------------------

PATTERNS = {
    "wgmma_s8": r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k32\.s32\.s8\.s8",
    "mma_s8": r"\bmma\.sync\.aligned\.m\d+n\d+k32\.row\.col\.s32\.s8\.s8",
    "cp_async_16": r"cp\.async\.c[ag]\.shared\.global \[[^\]]*\], \[[^\]]*\], 0x10",
    "ld_byte": r"ld\.global(\.\w+)*\.[bsu]8\b",
    "st_v4": r"st\.global(\.\w+)*\.v4\.b32",
}


def compile_all() -> dict[str, dict[str, int]]:
    from mxrl.kernels import triton_digest as td

    cfg = td.DEFAULT_CONFIG
    fn = td.digest_level_kernel
    report = {}
    for align in (16, 1):
        constexprs = {"ROW": ROW, "LANES": digest.LANES, "BLOCK_M": cfg["BLOCK_M"],
                      "BLOCK_K": cfg["BLOCK_K"], "ALIGN": align}  # fmt: skip
        sig = {"seg_ptr": "*i64", "num_segments": "i32", "coef_ptr": "*i8"}
        aligned = {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
        options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
        report[f"align_{align}"] = ptx_counts(
            fn, sig, constexprs, PATTERNS, options=options, attrs=aligned
        )
    return report


@pytest.fixture(scope="module")
def ptx_report():
    if not TRITON_IMPORTABLE:
        pytest.skip("needs triton (the sm_90 compiler)")
    return report_in_subprocess("tests.kernels.test_digest_kernel", timeout=600)


@pytest.mark.triton
def test_aligned_rows_stream_through_cp_async_into_int8_wgmma(ptx_report):
    counts = ptx_report["align_16"]
    assert counts["wgmma_s8"] > 0 and counts["cp_async_16"] > 0, counts
    # byte loads only for the partial last row (BLOCK_K / 128 threads per K step)
    assert counts["ld_byte"] <= 4, counts
    assert counts["st_v4"] > 0, counts


@pytest.mark.triton
def test_unaligned_variant_compiles(ptx_report):
    counts = ptx_report["align_1"]
    assert counts["wgmma_s8"] + counts["mma_s8"] > 0, counts


# --- benchmark (by hand, on a CUDA machine) -----------------------------------------------------


def _time(fn, repeats: int) -> float:
    """Median seconds of fn() on the current CUDA stream."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _copy_seconds(x: torch.Tensor, repeats: int) -> float:
    dst = torch.empty_like(x)
    return _time(lambda: dst.copy_(x), repeats)


def _level0_seconds(fn) -> float:
    """The first digest_level_kernel's device time in one call of fn (the level-0 pass of a
    single field), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [
        e for e in prof.events()
        if "digest_level_kernel" in e.name and e.device_type == torch.autograd.DeviceType.CUDA
    ]  # fmt: skip
    kernels.sort(key=lambda e: e.time_range.start)
    return kernels[0].time_range.elapsed_us() / 1e6 if kernels else float("nan")


def bench(gib: float = 6.2, repeats: int = 10, sweep: bool = False, device: str = "cuda") -> None:
    """GB/s of the checksum digests on one large field (the whole call, and its level-0 pass
    alone) and on a model-like batch of fields (two large, many small, one unaligned view),
    against a device copy (read + write) and the torch._int_mm reference measured in the same
    process; `sweep` times other launch configs, each checked byte for byte first."""
    from triton.runtime.errors import OutOfResources

    from mxrl.kernels import triton_digest as td

    dev = torch.device(device)
    n = int(gib * 2**30)
    big = torch.randint(-128, 128, (n,), dtype=torch.int8, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    sizes = [2048] * 40 + [n // 512] * 8 + [n // 32] * 2  # bf16 elements: norms ... experts
    batch = [torch.randn(k, device=dev, generator=g).to(torch.bfloat16) for k in sizes]
    batch.append(big[3 : 3 + min(n // 4, 2**24)])  # one unaligned view
    batch_bytes = sum(t.numel() * t.element_size() for t in batch)
    t_copy = _copy_seconds(big, repeats)
    print(f"device copy {n / 2**30:.2f} GiB: {2 * n / t_copy / 1e9:.0f} GB/s (read + write)")
    t_ref = _time(lambda: digest.field_digest_reference(big), max(2, repeats // 3))
    print(f"reference (torch._int_mm) one field: {t_ref * 1e3:.2f} ms, {n / t_ref / 1e9:.0f} GB/s")
    configs = [td.DEFAULT_CONFIG]
    if sweep:
        configs += [
            {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
            for bm in (64, 128) for bk in (128, 256, 512) for w in (4, 8) for s in (3, 4, 5)
            if {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": w, "num_stages": s} != configs[0]
        ]  # fmt: skip
    want_big = td.launch_checksum_digests([big])
    want_batch = td.launch_checksum_digests(batch)
    assert torch.equal(want_big.cpu(), reference([big]).cpu()), "the kernel is not the reference"
    for cfg in configs:
        try:
            got = td.launch_checksum_digests([big], cfg), td.launch_checksum_digests(batch, cfg)
        except OutOfResources as err:  # more shared memory than the SM has
            print(f"{cfg}: skipped ({str(err)[:80]})")
            continue
        assert torch.equal(got[0], want_big) and torch.equal(got[1], want_batch), cfg
        t_big = _time(lambda c=cfg: td.launch_checksum_digests([big], c), repeats)
        t_batch = _time(lambda c=cfg: td.launch_checksum_digests(batch, c), repeats)
        t_level0 = _level0_seconds(lambda c=cfg: td.launch_checksum_digests([big], c))
        print(
            f"{cfg}: one field {t_big * 1e3:.2f} ms {n / t_big / 1e9:.0f} GB/s "
            f"({n / t_big / (2 * n / t_copy):.2f} x copy bandwidth, {t_ref / t_big:.1f} x "
            f"reference), its level 0 {n / t_level0 / 1e9:.0f} GB/s; {len(batch)} fields "
            f"{batch_bytes / 2**30:.2f} GiB {t_batch * 1e3:.2f} ms "
            f"{batch_bytes / t_batch / 1e9:.0f} GB/s"
        )


if __name__ == "__main__":
    if "--bench" in sys.argv:  # [--sweep] [--gib G]
        gib = float(sys.argv[sys.argv.index("--gib") + 1]) if "--gib" in sys.argv else 6.2
        bench(gib=gib, sweep="--sweep" in sys.argv)
    else:
        assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"
        print(json.dumps(compile_all()))
