"""Where a `generate` call's time goes.

Prefill (default): B prompts prefilled and one token sampled (`max_new_tokens=1`); its wall
time against the GPU kernel time of the same call (torch.profiler), the kernels by GPU time and
the host's Python functions by own time (cProfile).

    python benchmarks/profile_generate.py --preset bf16 --batch 8 128 --prompt 128
    python benchmarks/profile_generate.py --batch 32 --dense-gemm grouped   # one launch a projection

RL-shaped (`--rl`): benchmarks/rollout.py's RL run (groups x samples sharing a prompt, sampled
at temperature 1, stop tokens spread over the vocabulary): wall time, the engine's steps and
the decode steps' time by batch size, then the host's functions by own time (cProfile, a
second call: its overhead inflates the host's share).

    python benchmarks/profile_generate.py --preset bf16 --rl --rl-new-tokens 1024

Wall time far above the kernel time is host work: launches, Python over tokens or requests,
host syncs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from common import ensure_repo_on_path
from engine_decode import model_config
from rollout import add_rl_shape_arguments, rl_prompts

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
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny layer shapes (the logic on a CPU)")
    ap.add_argument("--rl", action="store_true", help="the RL-shaped run (module doc)")
    ap.add_argument("--dense-gemm", default="tiles", choices=["tiles", "grouped"],
                    help="the engine's dense_gemm (docs/engine.md)")  # fmt: skip
    add_rl_shape_arguments(ap)
    args = ap.parse_args(argv)
    if args.rl:
        return rl(args)
    from torch.profiler import ProfilerActivity, profile

    model = build_model(model_config(layers=args.layers, vocab=32000, tiny=args.tiny), seed=0)
    engine = Engine(model, args.preset, device=args.device, compute_dtype=torch.bfloat16,
                    dense_gemm=args.dense_gemm)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    gen = torch.Generator().manual_seed(0)
    # the GPU's kernels; on the CPU (--tiny, the logic) its ops, as "kernels"
    cuda = torch.device(args.device).type == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU

    def own_us(e) -> float:
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    def fresh(b: int) -> list[list[int]]:
        """New prompts for every call: a repeated prompt would come from the prefix cache."""
        return torch.randint(1, 32000, (b, args.prompt), generator=gen).tolist()

    for b in args.batch:
        engine.generate(fresh(b), params)  # warm-up
        prompts = fresh(b)
        _sync()
        start = time.perf_counter()
        engine.generate(prompts, params)
        _sync()
        wall = time.perf_counter() - start
        prompts = fresh(b)
        with profile(activities=[activity]) as prof:
            engine.generate(prompts, params)
            _sync()
        events = [e for e in prof.key_averages() if e.device_type == kind]
        kernel_ms = sum(own_us(e) for e in events) / 1e3
        launches = sum(e.count for e in events)
        print(f"\n== {args.preset} [{args.dense_gemm}] B={b} prompt {args.prompt}: wall {wall * 1e3:.1f} ms, "
              f"{engine.stats.steps} steps, {launches} kernels, {kernel_ms:.1f} ms of kernel "
              f"time")  # fmt: skip
        events.sort(key=lambda e: -own_us(e))
        for e in events[: args.top]:
            print(f"  {own_us(e) / 1e3:9.2f} ms  x{e.count:5d}  {e.key[:100]}")
        prompts = fresh(b)
        print_host(lambda p=prompts: engine.generate(p, params), args.top)
    return 0


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def print_host(fn, top: int) -> None:
    """The host's Python functions by own time over fn() (cProfile)."""
    host = cProfile.Profile()
    host.enable()
    fn()
    _sync()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(top)
    print("\n".join(text.getvalue().splitlines()[6:]))


def rl(args) -> int:
    from mxrl.engine.params import GenerateStats

    model = build_model(model_config(layers=args.layers, vocab=32000, tiny=args.tiny), seed=0)
    engine = Engine(model, args.preset, device=args.device, compute_dtype=torch.bfloat16)
    prompts, stop = rl_prompts(model.config, args)
    params = SamplingParams(
        temperature=1.0, max_new_tokens=args.rl_new_tokens, stop_token_ids=stop, seed=0
    )
    # every launched step's rows, and whether each row feeds one token (a decode step: the
    # steps `GenerateStats.decode_step_s` times, read in the order they were launched)
    launched: list[tuple[int, bool]] = []
    observe = GenerateStats.observe

    def observed(self, batch, blocks):
        launched.append((len(batch), all(s.num_tokens == 1 for s in batch)))
        return observe(self, batch, blocks)

    GenerateStats.observe = observed
    engine.capture_graphs(args.rl_prompt + args.rl_new_tokens)
    engine.generate(prompts, params)  # warm-up: compiled kernels
    engine.reset_prefix_cache()
    launched.clear()
    _sync()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync()
    wall = time.perf_counter() - start
    st = engine.stats
    tokens = sum(len(o.tokens) for o in outs)
    steps = st.decode_step_s
    print(f"== RL {args.preset}: {len(prompts)} sequences, {tokens} tokens in {wall:.2f} s = "
          f"{tokens / wall:.0f} tok/s; {st.steps} steps ({st.graph_steps} graphs, "
          f"{st.ahead_steps} queued ahead, {st.ahead_rows_dropped} rows dropped); "
          f"{len(steps)} decode steps: {sum(steps):.2f} s, median "
          f"{statistics.median(steps) * 1e3:.2f} ms")  # fmt: skip
    decode_rows = [n for n, one in launched if one]
    by_rows: dict[int, list[float]] = {}
    for n, t in zip(decode_rows, steps, strict=True):
        by_rows.setdefault(next(b for b in (8, 32, 64, 128, 192, 256, n) if b >= n), []).append(t)
    for rows, ts in sorted(by_rows.items()):
        print(f"  decode steps of <= {rows} rows: {len(ts)}, median "
              f"{statistics.median(ts) * 1e3:.2f} ms, {sum(ts):.2f} s")  # fmt: skip
    engine.reset_prefix_cache()
    print_host(lambda: engine.generate(prompts, params), args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
