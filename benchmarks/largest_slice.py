"""The largest Qwen3-30B-A3B-shaped slice (decoder layers) that `mxrl train` accepts on one device,
per preset, by the memory estimate `mxrl train` checks before the model loads (`mxrl.rl.memory`).

    python benchmarks/largest_slice.py                       # one H200 (139.8 GiB), 32 x 8 x 256
    python benchmarks/largest_slice.py --capacity-gib 79.6 --out benchmarks/results/x.json

A computation on the CPU, not a run: the estimate is an upper bound on the measured peaks of
4-layer runs and 0.6 GiB under the one measured at 11 layers (docs/benchmarks.md, "Memory at RL
batch sizes"). Per preset and `rl.hold_bf16_weights` (auto, true, false): the most layers whose
estimate passes its check with fp32 masters, the micro-batch budget it derives there, and why
one more layer is refused. The batch is the arithmetic task's (7-token prompts) at
`--prompts` x `--samples` x `--new-tokens`, vocab 32000.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import ensure_repo_on_path
from families import _QWEN_KEYS, family_layer

ensure_repo_on_path()

from mxrl.arch import ModelConfig, tensors_from_hf_config  # noqa: E402
from mxrl.recipe import resolve  # noqa: E402
from mxrl.rl import memory  # noqa: E402
from mxrl.rl.config import TrainConfig  # noqa: E402

H200_BYTES = 150_109_880_320  # torch.cuda.get_device_properties(0).total_memory on the H200
PRESETS = ("bf16", "fp8-block", "fp8-block-quantized", "mxfp8", "nvfp4-dequantized")
PROMPT_TOKENS = 7  # the arithmetic task's longest prompt


def slice_config(layers: int) -> dict:
    return {**_QWEN_KEYS, **family_layer("qwen3-moe", False), "num_hidden_layers": layers,
            "vocab_size": 32000, "tie_word_embeddings": False}  # fmt: skip


def estimate(preset: str, hold, layers: int, capacity: int, args) -> memory.MemoryEstimate:
    rl = {"recipe": preset, "device": "cuda", "prompts_per_step": args.prompts,
          "samples_per_prompt": args.samples, "max_new_tokens": args.new_tokens,
          "hold_bf16_weights": hold}  # fmt: skip
    cfg = TrainConfig.from_dict({"model": "slice", "rl": rl})
    hf = slice_config(layers)
    plan = resolve(preset, tensors_from_hf_config(hf, "fused"))
    return memory.estimate_memory(
        ModelConfig.from_hf(hf), plan, cfg, prompt_tokens=PROMPT_TOKENS, capacity=capacity
    )


def largest(preset: str, hold, capacity: int, args) -> dict:
    """The most layers that pass the estimate's check (0: not one), and the refusal of one more."""
    best, refusal = None, ""
    for layers in range(1, args.max_layers + 1):
        est = estimate(preset, hold, layers, capacity, args)
        try:
            est.check()
        except ValueError as e:
            refusal = str(e)
            break
        best = (layers, est)
    row = {"preset": preset, "hold_bf16_weights": hold, "layers": best[0] if best else 0}
    if best:
        est = best[1]
        row |= {"micro_batch_tokens": est.micro_batch_tokens, "held": est.hold_bf16_weights,
                "peak_gib": round(est.peak / 2**30, 1)}  # fmt: skip
    return row | {"one_more_refused": refusal.split(";")[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity-gib", type=float, help="the device's memory (default: an H200's)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-layers", type=int, default=48)
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--out", help="write the rows as JSON")
    args = ap.parse_args(argv)
    capacity = int(args.capacity_gib * 2**30) if args.capacity_gib else H200_BYTES
    rows = [largest(p, h, capacity, args) for p in args.presets for h in ("auto", True, False)]
    for r in rows:
        print(f"{r['preset']:>20} hold {r['hold_bf16_weights']!s:>5}: {r['layers']:>2} layers, "
              f"micro-batches of {r.get('micro_batch_tokens', 0)} tokens, held "
              f"{r.get('held')}; one more: {r['one_more_refused'][:90]}")  # fmt: skip
    if args.out:
        batch = [args.prompts, args.samples, args.new_tokens]
        meta = {"capacity_bytes": capacity, "batch": batch, "prompt_tokens": PROMPT_TOKENS,
                "vocab": 32000, "how": "mxrl.rl.memory estimate"}  # fmt: skip
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
