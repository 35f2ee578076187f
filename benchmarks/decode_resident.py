"""Decode at long contexts with every sequence resident, against the step's byte floor.

    python benchmarks/decode_resident.py                       # H100/H200: 4 layers, 3840 + 256
    python benchmarks/decode_resident.py --split 0 512 --presets bf16 nvfp4-dequantized
    python benchmarks/decode_resident.py --tiny --device cpu   # the logic (tests/engine)

`engine_decode.py`'s step by difference ((t_N - t_1) / (N - 1)) is not a decode step at long
prompts: the engine admits prompts `max_num_batched_tokens` at a time (two 3840-token prompts a
step at 8192) and runs their prefill chunks beside the decode of the sequences already admitted.
Here every request gets `--new-tokens` (256 by default), so from the last admission on every
sequence is resident, and the row is the engine's own clock over its first `--window`
decode-only steps that decoded every request (`GenerateStats.decode_step_s` and
`decode_step_rows`: steps with no prefill chunk).

The floor is what such a step must read at the copy bandwidth measured in the same run: every
dense weight but the embedding, each MoE layer's experts routed to by the batch at that step,
and the K/V of every layer (`engine_decode.step_weight_bytes`: the routing aligned by position
in the response, the mean over the responses' positions; the K/V of the keys the window's steps
read, `GenerateStats.decode_step_keys`, in the cache's format). `--split` runs each preset with `attention_split` 0 (the one-pass
kernel) and the given split sizes; the rows say whether the greedy completions matched the
one-pass ones (other bytes: they may part where two logits were within rounding).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
from pathlib import Path

import torch
from common import (
    check_device,
    check_presets,
    copy_bandwidth,
    cpu_environment,
    ensure_repo_on_path,
    environment,
    format_table,
    update_results,
)
from engine_decode import step_weight_bytes, timed_generate
from families import describe, kv_token_bytes, model_config

ensure_repo_on_path()

from mxrl.engine import Engine  # noqa: E402
from mxrl.models import build_model  # noqa: E402
from mxrl.recipe import load_recipe, resolve  # noqa: E402


def plan_of(model, preset: str, kv_cache: str):
    """The preset's plan for `model`, its K/V cache `kv_cache` (the recipe's own: compute)."""
    recipe = load_recipe(preset)
    if kv_cache == "fp8":
        recipe = dataclasses.replace(recipe, name=f"{preset}-kv-fp8", kv_cache="fp8")
    return resolve(recipe, {n: p.shape for n, p in model.named_parameters()})


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    """Distinct prompts (no shared prefix: each starts with its own token)."""
    return [[1 + (7 * i + j) % (vocab - 1) for j in range(length)] for i in range(batch)]


def resident_row(engine: Engine, prompts, args) -> tuple[dict, list]:
    """One timed `generate` (after a warm-up call at the same batch: graphs, autotuning)."""
    timed_generate(engine, prompts, 8)
    engine.reset_prefix_cache()
    total, outs = timed_generate(engine, prompts, args.new_tokens)
    st, b, c = engine.stats, len(prompts), engine.config
    # the first `window` decode-only steps that decoded every request
    window = [i for i, rows in enumerate(st.decode_step_rows) if rows == b][: args.window]
    steps = [st.decode_step_s[i] for i in window]
    keys = statistics.fmean(st.decode_step_keys[i] for i in window) if window else 0.0
    kv_bytes = c.num_hidden_layers * keys * kv_token_bytes(c, engine._kv, engine._kv.dtype)
    weights = step_weight_bytes(engine, outs, args.prompt)
    row = {
        "batch": b,
        "total_s": total,
        "decode_only_steps": len(st.decode_step_s),
        "window_steps": len(steps),
        "step_ms": statistics.median(steps) * 1e3 if steps else None,
        "step_min_ms": min(steps) * 1e3 if steps else None,
        "peak_kv_blocks": st.peak_kv_blocks,
        "window_keys_per_layer": keys,
        "step_weight_bytes": weights,
        "step_kv_bytes": kv_bytes,
        "step_floor_bytes": weights + kv_bytes,
    }
    return row, [o.tokens for o in outs]


def run(model, args, device: torch.device) -> list[dict]:
    rows = []
    for preset in args.presets:
        one_pass: dict[int, list] = {}
        for split in args.split:
            plan = plan_of(model, preset, args.kv_cache)
            engine = Engine(model, plan, device=device, compute_dtype=torch.bfloat16,
                            attention_split=split)  # fmt: skip
            for b in args.batch:
                prompts = prompts_for(b, args.prompt, model.config.vocab_size)
                row, tokens = resident_row(engine, prompts, args)
                if split == 0:
                    one_pass[b] = tokens
                same = (
                    None
                    if b not in one_pass
                    else sum(x == y for x, y in zip(tokens, one_pass[b], strict=True))
                )
                rows.append({"preset": preset, "attention_split": split,
                             "kv_cache": args.kv_cache, "same_completions": same, **row})  # fmt: skip
                print(f"  {preset} split {split} B={b}: {row['step_ms']:.2f} ms/step "
                      f"({row['window_steps']} steps, {row['total_s']:.2f} s)", flush=True)  # fmt: skip
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


COLUMNS = [
    ("preset", "preset", ""),
    ("attention_split", "split", ""),
    ("batch", "B", ""),
    ("step_ms", "ms/step", ".2f"),
    ("floor_ms", "floor ms", ".2f"),
    ("x_floor", "x floor", ".2f"),
    ("step_weight_bytes", "weight B", ".3g"),
    ("step_kv_bytes", "K/V B", ".3g"),
    ("same_completions", "same as split 0", ""),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["bf16", "nvfp4-dequantized", "fp8-block"])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--split", type=int, nargs="+", default=[0, 512], help="0 first")
    p.add_argument("--prompt", type=int, default=3840)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--window", type=int, default=100, help="decode-only steps timed")
    p.add_argument("--kv-cache", default="compute", choices=["compute", "fp8"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="results JSON (a section is added)")
    p.add_argument("--section", default="decode_resident")
    args = p.parse_args(argv)
    check_presets(args.presets)
    if args.split[0] != 0:
        p.error("--split: the first value must be 0 (the one-pass rows the others compare with)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = check_device(args.device)
    config = model_config(layers=args.layers, vocab=args.vocab, tiny=args.tiny)
    model = build_model(config, seed=0)
    print(f"{describe(config, 'qwen3-moe')}; {device}; prompts {args.prompt} + {args.new_tokens}")
    rows = run(model, args, device)
    copy = copy_bandwidth(torch.empty(64 << 20, device=device)) if device.type == "cuda" else None
    for r in rows:
        r["floor_ms"] = None if copy is None else r["step_floor_bytes"] / copy["gbps"] / 1e6
        r["x_floor"] = r["floor_ms"] and r["step_ms"] / r["floor_ms"]
    print(format_table(rows, COLUMNS))
    if copy is not None:
        print(f"copy bandwidth (read + write) this run: {copy['gbps']:.0f} GB/s")
    if args.out is None:
        print("(no --out: results not written)")
        return 0
    env = environment() if device.type == "cuda" else cpu_environment()
    section = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "section")},
        "rows": rows,
        "copy_gbps_this_run": None if copy is None else copy["gbps"],
        "method": __doc__.split("\n\n", 2)[2].strip(),
    }
    update_results(Path(args.out), args.section, section, env)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
