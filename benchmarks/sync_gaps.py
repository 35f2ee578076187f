"""Where the in-process sync's device sits idle, and which host code it waits for.

    python benchmarks/sync_gaps.py                                 # 4-layer slice, four presets
    python benchmarks/sync_gaps.py --presets fp8-block --tree ../old  # mxrl from another checkout
    python benchmarks/sync_gaps.py --tiny                          # the CPU smoke run

Per preset, on `benchmarks/sync.py`'s model (the 4-layer Qwen3-30B-A3B slice, vocab 32000; or
its tiny layer with `--tiny`), an engine beside the fp32 masters and the GRPO loop's transport:
- the median ms of `--repeats` syncs (`export(..., sqnr=False, bucket_bytes=WHOLE_UPDATE)`
  then `InProcessTransport.send`) after three warm-up ones, and the engine's bytes over it;
- the same with the SQNR sampled as the loop does (`SqnrSample.at_step(step, 16)`);
- one more sync under `torch.profiler` (`--profile-sampled`: with the sampled SQNR), with the
  export's and the engine's steps annotated
  (`ANNOTATED`): the device's busy time, and each gap between its ops put on the innermost
  annotated host range running at the gap's midpoint ("idle ... during"), and with `--kernels
  N` its N longest device ops by total time. The profiler slows the host, so the gaps are an
  upper bound; the medians above are taken without it.

`--tree PATH` imports mxrl from PATH (another checkout, e.g. `git worktree add ../old HEAD~3`):
one process per tree, run one after the other on the same machine, is the A/B. Steps the other
tree lacks are left unannotated. Prints only.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys

ANNOTATED = (  # (module, attribute): the steps of one sync whose host time is named
    ("mxrl.weights.export", "check_finite"),  # read at once (trees before FiniteCheck)
    ("mxrl.weights.finite", "FiniteCheck.__init__"),
    ("mxrl.weights.finite", "FiniteCheck.result"),
    ("mxrl.weights.export", "_quantize"),
    ("mxrl.weights.event", "SqnrMeter.add"),
    ("mxrl.weights.digest", "PendingChecksums.__init__"),
    ("mxrl.weights.digest", "PendingChecksums.wait"),
    ("mxrl.engine.loading", "WeightLoading.load_weights"),
    ("mxrl.engine.loading", "WeightLoading._verify"),
    ("mxrl.engine.loading", "WeightLoading._stage_ahead"),
    ("mxrl.engine.loading", "WeightLoading._stage"),
    ("mxrl.engine.loading", "WeightLoading._installed"),
    ("mxrl.engine.loading", "check_record"),
    ("mxrl.engine.loading", "verified_records"),
    ("mxrl.engine.loading", "_copy_leaves"),
    ("mxrl.engine.loading", "_Verification.result"),
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--presets", nargs="+", default=["bf16", "fp8-block", "nvfp4-dequantized", "mxfp8"]
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tiny", action="store_true", help="the tiny layer, vocab 256 (CPU smoke run)")
    p.add_argument("--tree", default=None, help="import mxrl from this checkout instead")
    p.add_argument(
        "--profile-sampled", action="store_true", help="profile a sync with the sampled SQNR"
    )
    p.add_argument("--kernels", type=int, default=0, help="print the N longest device ops")
    return p.parse_args(argv)


def annotate(strict: bool, patch=setattr) -> list[str]:
    """Wrap each ANNOTATED step in a `record_function("@<name>")` (set with `patch`: a test
    passes monkeypatch.setattr); the names not found (only allowed with strict=False: another
    tree) are returned."""
    from torch.profiler import record_function

    missing = []
    for module_name, attr in ANNOTATED:
        try:
            owner = importlib.import_module(module_name)
        except ModuleNotFoundError:
            if strict:
                raise
            missing.append(f"{module_name}.{attr}")
            continue
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            if strict:
                raise AttributeError(f"sync_gaps: {module_name}.{attr} is gone; update ANNOTATED")
            missing.append(attr)
            continue

        def wrapped(*args, _fn=fn, _label=f"@{attr}", **kwargs):
            with record_function(_label):
                return _fn(*args, **kwargs)

        patch(owner, name, functools.wraps(fn)(wrapped))
    return missing


def idle_gaps(events, start_label: str = "@sync") -> tuple[float, float, dict[str, float]]:
    """(ms from the sync's start to its first device op, device busy ms, idle ms per innermost
    annotated host range) from a profile's events."""
    import torch

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ops = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == cuda)
    ranges = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == cpu and e.name.startswith("@")
    ]
    start = min(a for a, _, name in ranges if name == start_label)
    ops = [(a, b) for a, b in ops if b >= start]
    first = (ops[0][0] - start) / 1e3 if ops else 0.0
    busy, idle, cur = 0.0, {}, start
    for a, b in ops:
        if a > cur:
            mid = (a + cur) / 2
            inner = [r for r in ranges if r[0] <= mid <= r[1]]
            who = min(inner, key=lambda r: r[1] - r[0])[2] if inner else "(outside)"
            idle[who] = idle.get(who, 0.0) + (a - cur) / 1e3
        busy += max(0.0, b - max(a, cur)) / 1e3
        cur = max(cur, b)
    return first, busy, idle


def device_ops(events) -> list[tuple[str, float, int]]:
    """(name, total ms, calls) of each device op name in a profile's events, longest first."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    total: dict[str, list] = {}
    for e in events:
        if e.device_type == cuda:
            row = total.setdefault(e.name, [0.0, 0])
            row[0] += (e.time_range.end - e.time_range.start) / 1e3
            row[1] += 1
    return sorted(((n, ms, c) for n, (ms, c) in total.items()), key=lambda r: -r[1])


def main(argv=None, patch=setattr) -> int:
    args = parse_args(argv)
    if args.tree:  # that tree first; the repo root already present, so common.py adds nothing
        root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        sys.path[:0] = [os.path.abspath(args.tree), root]
    import torch
    from sync import config_of, timed

    from mxrl.engine import Engine
    from mxrl.models import build_model
    from mxrl.sync import InProcessTransport
    from mxrl.weights import WHOLE_UPDATE, export
    from mxrl.weights.event import SqnrSample

    missing = annotate(strict=args.tree is None, patch=patch)
    print(f"sync_gaps: mxrl from {os.path.dirname(importlib.import_module('mxrl').__file__)}"
          + (f"; not in this tree: {missing}" if missing else ""), flush=True)  # fmt: skip
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    model = build_model(config_of(args.layers, 256 if args.tiny else 32000, args.tiny), seed=0)
    model = model.to(dev)
    steps = iter(range(1, 1 << 30))

    for preset in args.presets:
        engine = Engine(model, preset, device=dev, compute_dtype=torch.bfloat16)
        transport = InProcessTransport(engine)

        def sync(sampled: bool = False, _engine=engine, _transport=transport) -> int:
            step = next(steps)
            with torch.profiler.record_function("@sync"):
                sqnr = SqnrSample.at_step(step, 16) if sampled else False
                update = export(
                    model, _engine.plan, step=step, sqnr=sqnr, bucket_bytes=WHOLE_UPDATE
                )
                return _transport.send(update).num_bytes

        for _ in range(2):
            sync()
        wall = timed(sync, dev, args.repeats)  # one more warm-up, then the median
        looped = timed(functools.partial(sync, sampled=True), dev, args.repeats)
        nbytes = sync()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            profiled = timed(
                functools.partial(sync, sampled=args.profile_sampled), dev, 1, warmup=False
            )
        first, busy, idle = idle_gaps(prof.events())
        print(
            f"{preset}: {wall * 1e3:.2f} ms a sync ({nbytes / wall / 1e9:.0f} GB/s of "
            f"{nbytes / 1e9:.3f} GB), {looped * 1e3:.2f} ms with the SQNR "
            f"sampled as the loop does; profiled {profiled * 1e3:.2f} ms: device busy "
            f"{busy:.2f} ms, first op {first:.2f} ms in",
            flush=True,
        )
        for who, ms in sorted(idle.items(), key=lambda kv: -kv[1]):
            print(f"    idle {ms:6.2f} ms during {who}")
        for name, ms, calls in device_ops(prof.events())[: args.kernels]:
            print(f"    device {ms:6.2f} ms in {calls:4d} x {name[:90]}")
        del engine, transport, sync
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
