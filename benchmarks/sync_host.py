"""The weight sync's host time: the loop's sync of a tiny model with many records, on the CPU.

    python benchmarks/sync_host.py                          # every preset, 8 layers, CPU
    python benchmarks/sync_host.py --presets mxfp8 --profile 25

Model: `benchmarks/sync.py`'s tiny Qwen3-MoE layer (hidden 128, 4 experts; every preset applies),
`--layers` layers (8: 11 records a layer), vocab 256, seeded fp32 masters. A sync is the GRPO
loop's (`mxrl.rl.trainer`): `InProcessTransport(engine).send(export(model, plan, step=s,
sqnr=SqnrSample.at_step(s, 16), bucket_bytes=WHOLE_UPDATE))`, then the engine's weights digest. With tensors this small the
tensor work is negligible, so the wall time is the host's: the per-record Python work and the
per-op dispatch a GPU sync pays on top of its kernels (on a GPU add the launches; the CPU runs
the reference quantizers and checksums instead of the Triton kernels, so their ops count
here and their launches do not).

Per preset: records per sync, the median ms per sync of `--repeats` after a warm-up, the median
and least ms per sync outside the kernel calls (the least: on a shared machine, the repeat least
disturbed), its ms per record, the torch ops dispatched per sync (a `TorchDispatchMode`
counting every aten op outside the kernel calls, each kernel call one op); with `--profile N`, the N mxrl functions of most own time under cProfile. Prints only
(a host measurement: the GPU rows live in `sync.py` and `rl_step.py`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import Counter

import torch
from common import check_presets, ensure_repo_on_path
from torch.utils._python_dispatch import TorchDispatchMode

ensure_repo_on_path()

from sync import config_of  # noqa: E402

from mxrl.engine import Engine  # noqa: E402
from mxrl.models import build_model  # noqa: E402
from mxrl.sync import InProcessTransport  # noqa: E402
from mxrl.weights import WHOLE_UPDATE, export  # noqa: E402
from mxrl.weights.digest import weights_digest  # noqa: E402
from mxrl.weights.event import SqnrSample  # noqa: E402

DEFAULT_PRESETS = ("mxfp8", "fp8-block", "nvfp4-dequantized", "bf16")
LOOP_SQNR_STRIDE = 16  # rl.sqnr_expert_stride's default
KERNEL_CALLS = (  # where the sync calls a kernel (the names as those modules bound them)
    (sys.modules["mxrl.weights.digest"], "field_digests"),
    (sys.modules["mxrl.weights.export"], "kernel_quantize"),  # the package's export() hides it
    (sys.modules["mxrl.weights.export"], "quantize_measured"),  # with the SQNR's and NaN's sums
    (sys.modules["mxrl.weights.event"], "error_sums"),
    # the engine's GEMM operands of a received QTensor (none where its GEMM reads it packed;
    # on the CPU an fp32 dequantization): mxrl/nn's, not the sync's
    (sys.modules["mxrl.nn.paths.rollout"], "received_weight"),
)


class KernelClock:
    """Wraps the kernel calls of a sync (a checksum batch, a quantization, an SQNR sum: a Triton
    op or few on CUDA, the references here): how many and the time spent inside them."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.seconds = 0.0
        self.inside = 0
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, fn, name: str):
        def call(*args, **kwargs):
            if self.inside:
                return fn(*args, **kwargs)
            self.calls[f"kernel:{name}"] += 1
            self.inside += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.inside -= 1

        return call

    def __enter__(self) -> KernelClock:
        for module, attr in KERNEL_CALLS:
            fn = getattr(module, attr)
            self._saved.append((module, attr, fn))
            setattr(module, attr, self._wrap(fn, attr))
        return self

    def __exit__(self, *exc) -> None:
        for module, attr, fn in reversed(self._saved):
            setattr(module, attr, fn)
        self._saved.clear()


class OpCounter(TorchDispatchMode):
    """Every aten op dispatched outside the kernel calls, by name (each kernel call one op)."""

    def __init__(self, clock: KernelClock) -> None:
        super().__init__()
        self.clock = clock
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.clock.inside:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> Counter[str]:
        return self.ops + self.clock.calls


def loop_sync(model, engine: Engine, transport: InProcessTransport, step: int) -> None:
    sample = SqnrSample.at_step(step, LOOP_SQNR_STRIDE)
    # the loop's actor exports for the engine beside it in one bucket (mxrl.rl.actor)
    transport.send(export(model, engine.plan, step=step, sqnr=sample, bucket_bytes=WHOLE_UPDATE))
    weights_digest(engine.hashes.items())


def measure(preset: str, model, args) -> dict:
    engine = Engine(model, preset, device="cpu", compute_dtype=torch.bfloat16)
    transport = InProcessTransport(engine)
    steps = iter(range(1, 10**6))
    loop_sync(model, engine, transport, next(steps))  # warm-up: first load installs buffers
    times, inside = [], []
    for _ in range(args.repeats):
        with KernelClock() as clock:
            t0 = time.perf_counter()
            loop_sync(model, engine, transport, next(steps))
            times.append(time.perf_counter() - t0)
        inside.append(clock.seconds)
    with KernelClock() as clock, OpCounter(clock) as counter:
        loop_sync(model, engine, transport, next(steps))
    ops = counter.total()
    outside = [t - k for t, k in zip(times, inside, strict=True)]
    row = {
        "preset": preset,
        "records": len(engine.plan),
        "ms_per_sync": statistics.median(times) * 1e3,
        "ms_outside_kernels": statistics.median(outside) * 1e3,
        # the least of the repeats: on a shared machine, the one least disturbed by others
        "ms_outside_kernels_min": min(outside) * 1e3,
        "ops_per_sync": sum(ops.values()),
        "kernel_calls": sum(clock.calls.values()),
        "top_ops": ops.most_common(10),
    }
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            loop_sync(model, engine, transport, next(steps))
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).sort_stats("tottime")
        stats.print_stats("mxrl", args.profile)
        row["profile"] = out.getvalue()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", type=int, default=0, help="cProfile: the N top mxrl functions")
    args = ap.parse_args(argv)
    check_presets(args.presets)
    torch.set_num_threads(1)
    model = build_model(config_of(args.layers, 256, True), seed=0)
    print(f"{'preset':>18} {'records':>7} {'ms/sync':>8} {'outside kernels':>15} {'min':>6} "
          f"{'ms/rec':>7} {'ops/sync':>8} {'kernel calls':>12} {'ops/rec':>7}")  # fmt: skip
    for preset in args.presets:
        r = measure(preset, model, args)
        n = r["records"]
        print(
            f"{preset:>18} {n:>7} {r['ms_per_sync']:>8.2f} {r['ms_outside_kernels']:>15.2f} "
            f"{r['ms_outside_kernels_min']:>6.2f} {r['ms_outside_kernels_min'] / n:>7.3f} "
            f"{r['ops_per_sync']:>8} {r['kernel_calls']:>12} {r['ops_per_sync'] / n:>7.1f}"
        )
        print(f"{'':>18} top ops: {r['top_ops']}")
        if "profile" in r:
            print(r["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
