"""Where a decode step's time goes: the kernels one eager decode step launches (torch.profiler,
GPU time per kernel name, launch count) against the step's CUDA-graph replay time.

    python benchmarks/profile_decode.py --preset bf16 --batch 1 32

The sum of kernel times is the floor a graph can reach without fusing kernels; the graph's
step time above it (one step at a time) is the launch gaps between kernels and the host's work
between steps, which overlapped decoding (the engine's default on CUDA, also printed) hides.
"""

from __future__ import annotations

import argparse

import torch
from common import ensure_repo_on_path
from engine_decode import model_config

ensure_repo_on_path()

from mxrl.engine import Engine, SamplingParams  # noqa: E402
from mxrl.models import build_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bf16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    model = build_model(model_config(layers=args.layers, vocab=32000, tiny=False), seed=0)
    for b in args.batch:
        prompts = [[1 + (7 * i + j) % 3000 for j in range(64)] for i in range(b)]
        params = SamplingParams(temperature=0.0, max_new_tokens=8)
        runs = {}
        # graph steps one at a time (the replay against the kernel time below), overlapped (the
        # default: each step queued before the one before it is read), eager
        for name, graphs, overlap in (
            ("graph", True, False),
            ("overlapped", True, True),
            ("eager", False, False),
        ):
            engine = Engine(
                model, args.preset, device="cuda", compute_dtype=torch.bfloat16,
                cuda_graphs=graphs, overlap=overlap,
            )  # fmt: skip
            engine.generate(prompts, params)  # warm-up (captures)
            engine.generate(prompts, params)
            runs[name] = sorted(engine.stats.decode_step_s)[len(engine.stats.decode_step_s) // 2]
            if not graphs:
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    # one-token prompts: every step (the first one too) feeds one token each
                    one = [p[:1] for p in prompts]
                    engine.generate(one, SamplingParams(temperature=0.0, max_new_tokens=4))
                steps = engine.stats.steps
            del engine
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total_us = sum(e.self_device_time_total for e in events) / steps
        launches = sum(e.count for e in events) / steps
        print(f"\n== {args.preset} B={b}: graph step {runs['graph'] * 1e3:.3f} ms (overlapped "
              f"{runs['overlapped'] * 1e3:.3f} ms), eager step "
              f"{runs['eager'] * 1e3:.3f} ms; per step (mean over {steps} one-token steps): "
              f"{launches:.0f} kernels, {total_us / 1e3:.3f} ms of kernel time")  # fmt: skip
        events.sort(key=lambda e: -e.self_device_time_total)
        for e in events[: args.top]:
            print(f"  {e.self_device_time_total / steps:9.1f} us  x{e.count / steps:6.1f}  "
                  f"{e.key[:110]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
