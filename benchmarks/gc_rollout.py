"""The Python garbage collector's pauses in one engine rollout, three ways, in one process.

    python benchmarks/gc_rollout.py                  # the tiny MoE model on the CPU, 32 x 8
    python benchmarks/gc_rollout.py --new-tokens 400 --device cuda

The same GRPO-shaped rollout (`--prompts` prompts of `--prompt` tokens, `--samples` samples
each, `--new-tokens` new tokens, temperature 1) runs:

1. `collector on`: the loop of `Engine.generate` with the collector as Python runs it;
2. `heap frozen`: the same after `gc.freeze()` (what `GRPOTrainer.run` does for its steps);
3. `collector paused`: `Engine.generate` as it runs now (`mxrl/engine/collector.py`; its one
   young collection is the one due when the collector comes back on, as `generate` returns),
   then one full collection, whose count of unreachable objects is what pausing left behind.

Each row: the rollout's seconds, the collector's pauses by generation (`gc.callbacks`: count and
milliseconds) and the tracked objects after it. Writes nothing.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from common import ensure_repo_on_path

ensure_repo_on_path()

from mxrl.arch import builtin_config  # noqa: E402
from mxrl.engine import Engine, SamplingParams  # noqa: E402
from mxrl.models import build_model  # noqa: E402
from mxrl.rl.metrics import GcPauses  # noqa: E402


def rollout(engine: Engine, args, collector: str) -> dict:
    """One rollout of the same requests; its row."""
    vocab = engine.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (args.prompt,), generator=g).tolist()
               for _ in range(args.prompts)]  # fmt: skip
    prompts = [p for p in prompts for _ in range(args.samples)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=i)
              for i in range(len(prompts))]  # fmt: skip
    engine.reset_prefix_cache()
    generate = engine.generate
    if collector != "collector paused":  # the loop itself, outside `collector_paused`
        raw = Engine.generate.__wrapped__.__wrapped__
        generate = torch.no_grad()(lambda p, s: raw(engine, p, s))
    if collector == "heap frozen":
        gc.collect()
        gc.freeze()
    pauses = GcPauses()  # this rollout's own clock, by generation
    gc.callbacks.append(pauses.callback)
    try:
        start = time.perf_counter()
        outs = generate(prompts, params)
        seconds = time.perf_counter() - start
    finally:
        gc.callbacks.remove(pauses.callback)
        gc.unfreeze()
    row = {"collector": collector, "rollout_s": seconds,
           "tokens": sum(len(o.tokens) for o in outs), "pauses": pauses.by_generation,
           "tracked_objects": len(gc.get_objects())}  # fmt: skip
    if collector == "collector paused":
        row["unreachable_after"] = gc.collect()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    model = build_model(builtin_config("tiny-moe"), seed=0).to(args.device)
    engine = Engine(model, "bf16", weight_dtype=torch.float32, tile=16)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))  # warm: caches, graphs
    gc.collect()
    for collector in ("collector on", "heap frozen", "collector paused"):
        row = rollout(engine, args, collector)
        pauses = ", ".join(f"gen{g} {n} x {1e3 * s:.1f} ms"
                           for g, (n, s) in sorted(row["pauses"].items())) or "none"  # fmt: skip
        total = sum(s for _, s in row["pauses"].values())
        extra = (f"; then {row['unreachable_after']} unreachable objects"
                 if "unreachable_after" in row else "")  # fmt: skip
        print(f"{collector}: rollout {row['rollout_s']:.1f} s ({row['tokens']} tokens); "
              f"collector {1e3 * total:.1f} ms ({pauses}); {row['tracked_objects']} tracked "
              f"objects{extra}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
