"""Where a decode step's time goes: the kernels one eager decode step launches (torch.profiler,
GPU time per kernel name, launch count) against the step's CUDA-graph replay time.

    python benchmarks/profile_decode.py --preset bf16 --batch 1 32
    python benchmarks/profile_decode.py --preset bf16 --batch 16 64 --prompt 4096   # long context

The sum of kernel times is the floor a graph can reach without fusing kernels; the graph's
step time above it (one step at a time) is the launch gaps between kernels and the host's work
between steps, which overlapped decoding (the engine's default on CUDA, also printed) hides.

With `--prompt N` (long contexts) the steps decode after N-token prompts: the eager call is
profiled twice, with 1 and with 1 + `--steps` new tokens (the prefix cache forgotten before
each, so both prefill the same prompts), and each kernel's time is the difference over the
steps: what the decode steps alone launched, at contexts N + 1 to N + `--steps`.
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
    ap.add_argument("--prompt", type=int, default=0, help="decode after N-token prompts")
    ap.add_argument("--steps", type=int, default=4, help="decode steps profiled (--prompt)")
    args = ap.parse_args(argv)
    from torch.profiler import profile

    model = build_model(model_config(layers=args.layers, vocab=32000, tiny=False), seed=0)
    for b in args.batch:
        length = args.prompt or 64
        prompts = [[1 + (7 * i + j) % 3000 for j in range(length)] for i in range(b)]
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
                events, steps = _profiled(engine, prompts, args.prompt, args.steps, profile)
            del engine
        total_us = sum(t for t, _ in events.values()) / steps
        launches = sum(c for _, c in events.values()) / steps
        print(f"\n== {args.preset} B={b}: graph step {runs['graph'] * 1e3:.3f} ms (overlapped "
              f"{runs['overlapped'] * 1e3:.3f} ms), eager step "
              f"{runs['eager'] * 1e3:.3f} ms; per step (mean over {steps} one-token steps): "
              f"{launches:.0f} kernels, {total_us / 1e3:.3f} ms of kernel time")  # fmt: skip
        ctx = f" after {args.prompt}-token prompts" if args.prompt else ""
        print(f"  (kernels of the decode steps{ctx})")
        for key, (t, c) in sorted(events.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"  {t / steps:9.1f} us  x{c / steps:6.1f}  {key[:110]}")
    return 0


def _kernels(prof) -> dict[str, tuple[float, int]]:
    """GPU time (us) and launches per kernel name of a profile."""
    cuda = torch.autograd.DeviceType.CUDA
    return {
        e.key: (e.self_device_time_total, e.count)
        for e in prof.key_averages()
        if e.device_type == cuda
    }


def _profiled(engine, prompts, prompt: int, steps: int, profile):
    """(kernel name -> (us, launches) of the profiled decode steps, the number of steps).
    Short prompts: one-token prompts, so every step (the first one too) feeds one token each.
    Long prompts: the difference of two profiled calls (module docstring)."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CUDA, ProfilerActivity.CPU]
    if not prompt:
        with profile(activities=activities) as prof:
            one = [p[:1] for p in prompts]
            engine.generate(one, SamplingParams(temperature=0.0, max_new_tokens=4))
        return _kernels(prof), engine.stats.steps
    runs = []
    for new in (1, 1 + steps):
        engine.reset_prefix_cache()
        with profile(activities=activities) as prof:
            engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new))
        runs.append(_kernels(prof))
    short, long = runs
    diff = {}
    for key, (t, c) in long.items():
        t0, c0 = short.get(key, (0.0, 0))
        if c > c0:
            diff[key] = (t - t0, c - c0)
    return diff, steps


if __name__ == "__main__":
    raise SystemExit(main())
