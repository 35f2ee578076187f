"""benchmarks/sync_host.py on the CPU: each kernel the sync calls counts as one call, so what
it reports as host work is the sync's own: the reference quantizers' ops, which a GPU runs as
one Triton launch, are not counted one by one (they were, for every quantized tensor, once the
export quantized through `quantize_measured` and the script still wrapped `quantize` only)."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.mark.parametrize("preset", ["mxfp8", "fp8-block"])
def test_the_export_quantizer_is_one_kernel_call(preset):
    with pytest.MonkeyPatch.context() as mp:
        bench = load_benchmark("sync_host", mp, "sync_host_bench")
        model = bench.build_model(bench.config_of(2, 256, True), seed=0)
        row = bench.measure(preset, model, argparse.Namespace(repeats=1, profile=0))
    ops = dict(row["top_ops"])
    assert ops.get("kernel:quantize_measured", 0) + ops.get("kernel:kernel_quantize", 0) > 0, ops
    # the sync's own ops, 6.9 a record (the reference MXFP8 quantizer alone adds ~25)
    assert row["ops_per_sync"] < 8 * row["records"], (row["ops_per_sync"], row["records"])
