"""Train-rollout mismatch on the built-in tiny MoE: the table of docs/mismatch.md.

For each configuration, the engine samples `--prompts` prompts x `--tokens` tokens at
temperature 1; the trainer (plan applied, fp32 master weights) recomputes the logprobs of the
same tokens; mismatch_metrics compares them. Rows: the consistent contract for bf16, mxfp8 and
nvfp4-dequantized, with the engine storing bf16-format tensors in fp32 or bf16, and an engine
that breaks the contract (per-tensor NVFP4 activation scales while the trainer uses per-token).

    python benchmarks/mismatch.py [--prompts 32] [--tokens 32] [--seed 0] [--markdown]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxrl.app.probe import measure_mismatch
from mxrl.arch import builtin_config
from mxrl.engine import Engine, SamplingParams
from mxrl.models import build_model
from mxrl.nn import apply_plan
from mxrl.recipe import resolve
from tests.engine.test_mismatch import BROKEN_NVFP4

ROWS = [
    ("bf16", "bf16", None),
    ("mxfp8", "mxfp8", None),
    ("nvfp4-dequantized", "nvfp4-dequantized", None),
    ("nvfp4-dequantized", "per-tensor activations (broken)", BROKEN_NVFP4),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(1, 64) for _ in range(rng.randrange(3, 12))] for _ in range(args.prompts)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.tokens, seed=args.seed)
    print(
        f"tiny-moe, {args.prompts} prompts x {args.tokens} tokens, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}\n"
    )
    print(
        "| trainer plan | engine | engine bf16-tensor storage | mean abs dlogp | max abs dlogp "
        "| k1 | k3 |"
    )
    print("|---|---|---|---|---|---|---|")
    for preset, label, engine_recipe in ROWS:
        for storage in (torch.float32, torch.bfloat16):
            trainer = build_model(builtin_config("tiny-moe"), seed=args.seed)
            engine = Engine(trainer, engine_recipe or preset, weight_dtype=storage)
            apply_plan(
                trainer, resolve(preset, {n: p.shape for n, p in trainer.named_parameters()})
            )
            m = measure_mismatch(trainer, engine, prompts, params)
            kind = "fp32" if storage == torch.float32 else "bf16"
            print(
                f"| {preset} | {label if engine_recipe else 'same plan'} | {kind} | "
                f"{m.logp_abs_diff_mean:.2e} | {m.logp_abs_diff_max:.2e} | {m.k1:.2e} | "
                f"{m.k3:.2e} |"
            )


if __name__ == "__main__":
    main()
