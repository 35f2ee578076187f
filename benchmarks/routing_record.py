"""The host cost of the rollout's routing record: the parts each request keeps and the join that
makes its completion's `routed_experts`.

    python benchmarks/routing_record.py                     # the tiny MoE model on the CPU
    python benchmarks/routing_record.py --device cuda --requests 64

Every decode step records one routing row per request (`Sequence.record_routing`); the
completion joins a request's parts into one [layers, positions, k] tensor after the rollout,
on the host, outside any overlap with the device. One rollout of `--requests` requests of
`--prompt` tokens and `--new-tokens` new tokens (greedy, distinct prompts) prints the parts
the requests hold when the rollout ends and the seconds `Engine._completion` took for all of
them (the joins), against the rollout's wall time. Writes nothing.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import ensure_repo_on_path

ensure_repo_on_path()

from mxrl.arch import builtin_config  # noqa: E402
from mxrl.engine import Engine, SamplingParams  # noqa: E402
from mxrl.models import build_model  # noqa: E402


def measure(engine: Engine, args) -> dict:
    """One rollout; its row: wall seconds, the completions' seconds, the parts joined."""
    vocab = engine.config.vocab_size
    prompts = [[1 + (7 * i + j) % (vocab - 1) for j in range(args.prompt)]
               for i in range(args.requests)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    joins = {"s": 0.0, "parts": 0}
    completion = engine._completion

    def timed(seq):
        joins["parts"] += len(seq.routing)
        start = time.perf_counter()
        out = completion(seq)
        joins["s"] += time.perf_counter() - start
        return out

    engine._completion = timed
    try:
        engine.reset_prefix_cache()
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
    finally:
        del engine._completion
    tokens = sum(len(o.tokens) for o in outs)
    return {"rollout_s": wall, "completions_s": joins["s"], "parts": joins["parts"],
            "tokens": tokens}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=224)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    model = build_model(builtin_config("tiny-moe"), seed=0).to(args.device)
    engine = Engine(model, "bf16", weight_dtype=torch.float32, tile=16)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))  # warm: caches, graphs
    row = measure(engine, args)
    print(f"{args.requests} requests x {args.new_tokens} new tokens ({row['tokens']} tokens): "
          f"rollout {row['rollout_s']:.2f} s; completions {1e3 * row['completions_s']:.1f} ms "
          f"joining {row['parts']} routing parts ({row['parts'] / args.requests:.0f} a request)",
          flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
