"""Where a prefill's time goes: B prompts prefilled and one token sampled (`max_new_tokens=1`),
its wall time against the GPU kernel time of the same call (torch.profiler), the kernels by GPU
time and the host's Python functions by own time (cProfile).

    python benchmarks/profile_prefill.py --preset bf16 --batch 8 128 --prompt 128

Wall time far above the kernel time is host work: launches, Python over tokens or requests,
host syncs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from common import ensure_repo_on_path
from engine_decode import model_config

ensure_repo_on_path()

from mxrl.engine import Engine, SamplingParams  # noqa: E402
from mxrl.models import build_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bf16")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 128])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    model = build_model(model_config(layers=args.layers, vocab=32000, tiny=False), seed=0)
    engine = Engine(model, args.preset, device="cuda", compute_dtype=torch.bfloat16)
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    gen = torch.Generator().manual_seed(0)
    for b in args.batch:
        prompts = torch.randint(1, 32000, (b, args.prompt), generator=gen).tolist()
        engine.generate(prompts, params)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_ms = sum(e.self_device_time_total for e in events) / 1e3
        launches = sum(e.count for e in events)
        print(f"\n== {args.preset} B={b} prompt {args.prompt}: wall {wall * 1e3:.1f} ms, "
              f"{engine.stats.steps} steps, {launches} kernels, {kernel_ms:.1f} ms of kernel "
              f"time")  # fmt: skip
        events.sort(key=lambda e: -e.self_device_time_total)
        for e in events[: args.top]:
            print(f"  {e.self_device_time_total / 1e3:9.2f} ms  x{e.count:5d}  {e.key[:100]}")
        host = cProfile.Profile()
        host.enable()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        host.disable()
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(args.top)
        print("\n".join(text.getvalue().splitlines()[6:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
