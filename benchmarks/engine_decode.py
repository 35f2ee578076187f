"""Rollout-engine decode (`mxrl.engine.Engine.generate`, greedy) under the bf16, mxfp8 and nvfp4
presets, on a Qwen3-MoE model with Qwen3-30B-A3B layer shapes (or, `--family deepseek-v3`, a
DeepSeek-V3 model with Moonlight-16B-A3B's layers: benchmarks/families.py): weight bytes the
engine holds and decode throughput, each as a ratio to the bf16 preset measured in the same run.
Writes the `engine_decode` section (DeepSeek: `engine_decode_deepseek_v3`) of
benchmarks/results/h200.json on CUDA (other sections are kept).

    python benchmarks/engine_decode.py [--family qwen3-moe] [--layers 4] [--vocab 32000]
        [--batch 1 8 32] [--prompt 16] [--new-tokens 32] [--repeats 3]
        [--presets bf16 mxfp8 nvfp4-dequantized] [--device cuda] [--out PATH] [--quick] [--tiny]
        [--hf | --no-hf]

DeepSeek-V3 (`--family deepseek-v3`): the first layer dense (its whole MLP is read every step),
the others MoE with 2 shared experts; every preset keeps MLA, the routers and the shared experts
in bf16 (docs/models.md), so only the dense MLP and the routed experts change format. The engine
runs MLA with the expanded per-head K/V cache and the reference attention (no Triton paged
attention, no CUDA-graph decode: docs/models.md), which these rows include. With `--hf` (the
default for deepseek-v3) the rows of preset "hf" are transformers' `generate` on the same
weights (benchmarks/hf_decode.py: bf16, `experts_implementation="grouped_mm"` where transformers
takes it, else eager, named in the row), timed as the engine's, and each engine row gets
`speedup_vs_hf`. At the start, the slice's parameter count and its parameters active per token.

Model: hidden 2048, 32 query / 4 kv heads of 128, 128 experts (top-8) of intermediate 768, no
shared expert (Qwen3-30B-A3B's layer), `--layers` layers, `--vocab` tokens, seeded random init
(fp32 master weights, `mxrl.models.build_model`); the engine computes in bf16. "nvfp4" is the
`nvfp4-dequantized` preset (its rollout weights and forward equal `nvfp4-hp`'s: the two differ
only in the trainer's backward). Every preset keeps the last 15% of layers (at least one) in bf16,
so `--quick` uses 2 layers, not 1: with one layer every preset would be bf16 throughout.

Per preset, the engine is built from the exported records of the same master weights
(`export_weights` -> `Engine.from_records`, the path weight sync takes), and we record
- weights: `torch.cuda.memory_allocated()` after minus before loading (CUDA only); the bytes of
  every distinct tensor storage the engine's modules hold ("held": on the CPU the only measure);
  and the contract bytes (sum of `engine.weights` nbytes: packed codes + scales, bf16 tensors).
  On the triton backend NVFP4/MXFP8 weights stay packed (held = contract); the reference backend
  (CPU) also keeps each quantized weight's dequantized fp32 GEMM operands (nn/paths/rollout.py);
- decode: B prompts of `--prompt` random tokens, `--new-tokens` greedy tokens each. After one
  untimed warm-up call of each kind, each repeat times generate() with N new tokens (t_N) and
  with 1 (t_1: prefill plus one sample), by wall clock between torch.cuda.synchronize() calls;
  medians over repeats. ms per decode step = (t_N - t_1) / (N - 1) (one step feeds the whole
  batch); tokens/s = B * N / t_N (end to end); decode tokens/s = B / step time. Beside it,
  `decode_step_ms`: the median of the engine's own clock over the timed N-token calls' decode-only
  steps (`GenerateStats.decode_step_s`, as benchmarks/rollout.py reports). At long prompts the
  difference is not a decode step: on an H100 at 4064-token prompts, B = 64, it gave 6.85 ms
  where the decode-only steps took 2.6-3.2 ms (docs/benchmarks.md, "Decode at 4k contexts");
- contract weight bytes one decode step must read (dense weights without the embedding, plus,
  per MoE layer, the experts the batch routed to at that step, from the completions' routing
  record) per second, against `dst.copy_(x)` bandwidth measured in this run (CUDA);
- floor: those weight bytes plus the K/V bytes the step's attention reads (every layer, each
  request's prompt and the tokens fed so far, its own included), `step_floor_bytes`, in the
  cache the engine holds (bf16; MLA: the expanded per-head keys of qk_nope + qk_rope and values
  of v_head_dim, `engine.kv_cache.cache_dims`); `step_floor_latent_bytes` (MLA only) with the
  K/V term of a latent cache instead (kv_lora_rank + qk_rope_head_dim per token and layer: what
  the engine would reach with one; it has none). On CUDA, `floor_ms` / `floor_latent_ms`: those
  bytes at the copy bandwidth of this run;
- determinism: greedy tokens (and logprobs, bitwise) identical across the warm-up and every
  repeat; batch invariance: the first requests' tokens identical at every batch size.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from common import (
    REPO_ROOT,
    check_device,
    check_presets,
    copy_bandwidth,
    cpu_environment,
    decode_timing,
    ensure_repo_on_path,
    environment,
    format_table,
    gbps,
    update_results,
)
from families import (  # noqa: F401  (QWEN3_30B_A3B_LAYER, model_config: for the other scripts)
    FAMILIES,
    QWEN3_30B_A3B_LAYER,
    add_floor_ms,
    describe,
    family_layer,
    model_config,
    param_counts,
    step_kv_bytes,
)
from hf_decode import add_hf_ratios, hf_decode_rows
from torch import nn

ensure_repo_on_path()

from mxrl.engine import Engine, SamplingParams  # noqa: E402
from mxrl.formats import QTensor  # noqa: E402
from mxrl.models import build_model  # noqa: E402
from mxrl.recipe import resolve  # noqa: E402
from mxrl.weights import export_weights  # noqa: E402

DEFAULT_PRESETS = ("bf16", "mxfp8", "nvfp4-dequantized")
BASELINE = "bf16"
_BYTES = ("gpu_allocated_bytes", "held_bytes", "contract_bytes")  # the weight measures


def _tensors_in(obj: object, depth: int = 0):
    """Tensors reachable from an attribute value (QTensors, dataclasses such as QWeight,
    dicts, lists); submodules are walked by the caller."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, QTensor):
        yield from obj.tensors().values()
    elif depth > 4 or isinstance(obj, (nn.Module, str, bytes, type)):
        return
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name), depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth + 1)


def held_bytes(engine: Engine) -> int:
    """Bytes of every distinct storage the engine's modules and weight table reference (views
    counted once, whole storage), whatever form the engine keeps its weights in."""
    storages: dict[tuple, int] = {}
    roots = [v for m in engine.net.modules() for v in vars(m).values()]
    for t in (t for root in [*roots, engine.weights] for t in _tensors_in(root)):
        if t.device.type == "meta":
            continue
        s = t.untyped_storage()
        storages[(t.device, s.data_ptr())] = s.nbytes()
    return sum(storages.values())


def _nbytes(v: QTensor | torch.Tensor) -> int:
    return v.nbytes if isinstance(v, QTensor) else v.numel() * v.element_size()


def _experts_of(name: str) -> str | None:
    """'model.layers.3' for a routed-expert tensor of layer 3, else None."""
    head, _, tail = name.rpartition(".mlp.experts.")
    return head if tail in ("gate_up_proj", "down_proj") else None


def weight_summary(engine: Engine) -> dict:
    params: dict[str, int] = {}
    for _, spec in engine.plan.items():
        fmt = str(spec.format)
        params[fmt] = params.get(fmt, 0) + math.prod(spec.shape)
    return {
        "params_by_format": params,
        "contract_bytes": sum(_nbytes(v) for v in engine.weights.values()),
        "held_bytes": held_bytes(engine),
    }


def step_weight_bytes(engine: Engine, outs: list, prompt_len: int) -> float:
    """Mean contract bytes one decode step reads: every dense weight but the embedding (a row
    gather), plus each MoE layer's experts routed to by at least one request at that step."""
    per_step = weight_bytes_by_position(engine, outs, prompt_len)
    return sum(per_step) / len(per_step)


def weight_bytes_by_position(engine: Engine, outs: list, prompt_len: int) -> list[float]:
    """The weight bytes of each decode step s = 0, 1, ... (the one feeding the tokens at position
    `prompt_len + s`) with the requests decoding in lockstep: the dense weights but the
    embedding, plus each MoE layer's experts routed to by at least one request still decoding
    there (a request of n tokens feeds its first n - 1). One entry (the dense bytes) when no
    step decodes."""
    dense, per_expert = 0, {}
    for name, v in engine.weights.items():
        layer = _experts_of(name)
        if layer is not None:
            per_expert[layer] = per_expert.get(layer, 0) + _nbytes(v) // engine.config.num_experts
        elif not name.endswith("embed_tokens.weight"):
            dense += _nbytes(v)
    routing = [o.routed_experts for o in outs if o.routed_experts is not None]
    fed = [len(o.tokens) - 1 for o in outs if o.routed_experts is not None]
    steps = max(fed, default=0)
    if steps < 1:
        return [float(dense)]
    experts = engine.config.num_experts
    total = torch.zeros(steps, dtype=torch.float64)
    for j, layer_idx in enumerate(engine.config.moe_layers):
        hits = torch.zeros(steps * experts, dtype=torch.int64)
        for r, n in zip(routing, fed, strict=True):  # step s, expert e at s * experts + e
            picked = r[j, prompt_len : prompt_len + n].to("cpu", torch.int64)
            flat = picked + torch.arange(n).unsqueeze(1) * experts
            hits.index_add_(0, flat.flatten(), torch.ones(flat.numel(), dtype=torch.int64))
        active = (hits.view(steps, experts) > 0).sum(1)
        total += active.double() * per_expert[f"model.layers.{layer_idx}"]
    return (total + dense).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(engine: Engine, prompts: list[list[int]], new_tokens: int):
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    _sync(engine.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync(engine.device)
    return time.perf_counter() - start, outs


def bench_batch(engine: Engine, prompts: list[list[int]], args) -> tuple[dict, list]:
    n = args.new_tokens
    _, first = timed_generate(engine, prompts, n)  # warm-up (allocator, autotuning, caches)
    timed_generate(engine, prompts, 1)  # and of the prefill-only call (its cache shapes)
    t_n, t_1, runs, steps_s = [], [], [first], []
    for _ in range(args.repeats):
        t, outs = timed_generate(engine, prompts, n)
        t_n.append(t)
        steps_s += engine.stats.decode_step_s  # the decode-only steps, by the engine's clock
        runs.append(outs)
        t_1.append(timed_generate(engine, prompts, 1)[0])
    timing = decode_timing(t_n, t_1, len(prompts), n)
    timing["decode_step_ms"] = statistics.median(steps_s) * 1e3 if steps_s else None
    b, step_ms = timing["batch"], timing["ms_per_step"]
    tokens = [[o.tokens for o in outs] for outs in runs]
    same_logprobs = all(
        torch.equal(o.logprobs, f.logprobs)
        for outs in runs[1:]
        for o, f in zip(outs, first, strict=True)
    )
    step_bytes = step_weight_bytes(engine, first, args.prompt)
    kv = step_kv_bytes(engine, b, args.prompt, n - 1)
    latent = kv["kv_latent_bytes"]
    row = {
        **timing,
        "step_weight_bytes": step_bytes,
        "weight_gbps": None if step_ms is None else gbps(int(step_bytes), step_ms),
        "step_kv_bytes": kv["kv_bytes"],
        "step_kv_latent_bytes": latent,
        "step_floor_bytes": step_bytes + kv["kv_bytes"],
        "step_floor_latent_bytes": None if latent is None else step_bytes + latent,
        "deterministic": all(t == tokens[0] for t in tokens[1:]),
        "logprobs_identical": same_logprobs,
        "repeats": args.repeats,
    }
    return row, [o.tokens for o in first]


def bench_preset(model, preset: str, device: torch.device, prompts, args) -> tuple[dict, list]:
    plan = resolve(preset, {n: p.shape for n, p in model.named_parameters()})
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        _sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    engine = Engine.from_records(
        model.config,
        plan,
        export_weights(model.named_parameters(), plan),
        device=device,
        compute_dtype=torch.bfloat16,
    )
    _sync(device)
    info = {
        "preset": preset,
        "backend": str(engine.backend),
        "load_s": time.perf_counter() - start,
        **weight_summary(engine),
        "gpu_allocated_bytes": None,
        "gpu_load_peak_bytes": None,
    }
    if device.type == "cuda":
        info["gpu_allocated_bytes"] = torch.cuda.memory_allocated(device) - before
        info["gpu_load_peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
    formats = ", ".join(f"{f} {n / 1e6:.1f}M" for f, n in info["params_by_format"].items())
    print(f"  {preset}: loaded in {info['load_s']:.1f} s; params by format: {formats}")
    rows, tokens = [], {}
    for b in args.batch:
        row, tokens[b] = bench_batch(engine, prompts[:b], args)
        rows.append({"preset": preset, "backend": info["backend"], **row})
        print(f"  {preset} B={b}: {row['tokens_per_s']:.1f} tok/s ({row['total_s']:.2f} s)")
    smallest = min(args.batch)
    info["batch_invariant"] = all(tokens[b][:smallest] == tokens[smallest] for b in args.batch)
    info["deterministic"] = all(r["deterministic"] for r in rows)
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info, rows


def add_ratios(weights: list[dict], rows: list[dict]) -> None:
    """Ratios to the bf16 preset of this run (None where bf16 was not run)."""
    base = next((w for w in weights if w["preset"] == BASELINE), None)
    for w in weights:
        for key in _BYTES:
            ok = base is not None and w[key] is not None and base[key]
            w[f"{key}_vs_bf16"] = w[key] / base[key] if ok else None
    base_rows = {r["batch"]: r for r in rows if r["preset"] == BASELINE}
    for r in rows:
        b = base_rows.get(r["batch"])
        ok = b is not None and b["ms_per_step"] and r["ms_per_step"]
        r["speedup_vs_bf16"] = b["ms_per_step"] / r["ms_per_step"] if ok else None
        r["e2e_speedup_vs_bf16"] = b["total_s"] / r["total_s"] if b else None


WEIGHT_COLUMNS = [
    ("preset", "preset", "s"),
    ("gpu_allocated_mb", "GPU alloc MB", ".1f"),
    ("gpu_allocated_bytes_vs_bf16", "x bf16", ".2f"),
    ("held_mb", "held MB", ".1f"),
    ("held_bytes_vs_bf16", "x bf16", ".2f"),
    ("contract_mb", "contract MB", ".1f"),
    ("contract_bytes_vs_bf16", "x bf16", ".2f"),
    ("load_s", "load s", ".1f"),
    ("deterministic", "determ.", ""),
    ("batch_invariant", "batch inv.", ""),
]
DECODE_COLUMNS = [
    ("preset", "preset", "s"),
    ("batch", "B", "d"),
    ("ms_per_step", "ms/step", ".2f"),
    ("decode_step_ms", "engine step ms", ".2f"),
    ("decode_tokens_per_s", "decode tok/s", ".1f"),
    ("tokens_per_s", "tok/s (e2e)", ".1f"),
    ("speedup_vs_bf16", "x bf16", ".2f"),
    ("weight_gbps", "weight GB/s", ".2f"),
    ("floor_ms", "floor ms", ".2f"),
    ("floor_latent_ms", "latent floor ms", ".2f"),
    ("speedup_vs_hf", "x HF", ".2f"),
    ("deterministic", "determ.", ""),
]


def print_tables(weights: list[dict], rows: list[dict]) -> None:
    def mb(v: int | None) -> float | None:
        return None if v is None else v / 1e6

    shown = [{**w, **{k.removesuffix("_bytes") + "_mb": mb(w[k]) for k in _BYTES}} for w in weights]
    print(format_table(shown, WEIGHT_COLUMNS))
    print()
    print(format_table(rows, DECODE_COLUMNS))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    ap.add_argument(
        "--family", choices=FAMILIES, default="qwen3-moe", help="benchmarks/families.py"
    )
    ap.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        help="HF transformers generate rows on the same weights (default: on for deepseek-v3; "
        "Qwen's HF decode comparison is benchmarks/rollout.py)",
    )
    ap.add_argument("--layers", type=int, help="decoder layers (default 4; --quick/--tiny 2)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default 32000; --tiny 128)")
    ap.add_argument("--batch", type=int, nargs="+", help="batch sizes (default 1 8 32)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    ap.add_argument("--new-tokens", type=int, help="greedy tokens per request (default 32)")
    ap.add_argument("--repeats", type=int, help="timed calls after the warm-up (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="results JSON (default on CUDA: benchmarks/results/h200.json)")
    ap.add_argument("--quick", action="store_true", help="2 layers, batch 1 4, 8 new tokens")
    ap.add_argument("--tiny", action="store_true", help="tiny layer shapes (hidden 64, 4 experts)")
    args = ap.parse_args(argv)
    quick = args.quick
    defaults = {
        "layers": 2 if quick or args.tiny else 4,
        "vocab": 128 if args.tiny else 32000,
        "batch": [1, 4] if quick else [1, 8, 32],
        "new_tokens": 8 if quick else 32,
        "repeats": 1 if quick else 3,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("layers", "vocab", "prompt", "repeats"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be >= 1")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (a decode step is timed as t_N - t_1)")
    if min(args.batch) < 1:
        ap.error("--batch sizes must be >= 1")
    args.batch = sorted(set(args.batch))
    if args.hf is None:
        args.hf = args.family == "deepseek-v3"
    return args


def section_name(family: str) -> str:
    """`engine_decode` for Qwen (its readers unchanged); the DeepSeek rows in a section of their
    own, so neither run overwrites the other's."""
    return "engine_decode" if family == "qwen3-moe" else "engine_decode_deepseek_v3"


def model_section(config, args: argparse.Namespace, counts: dict) -> dict:
    """The slice as the results record it: its family, depth, vocabulary, layer keys, counts."""
    return {
        "family": args.family,
        "model_type": config.model_type,
        **{k: getattr(config, k) for k in ("num_hidden_layers", "vocab_size")},
        **family_layer(args.family, args.tiny),
        **counts,
        "master_dtype": "float32",
        "init_seed": args.seed,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_presets(args.presets)
    device = check_device(args.device)
    out = args.out or (
        str(REPO_ROOT / "benchmarks/results/h200.json") if device.type == "cuda" else None
    )
    config = model_config(layers=args.layers, vocab=args.vocab, tiny=args.tiny, family=args.family)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(config, device=device, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, config.vocab_size, (max(args.batch), args.prompt), generator=gen)
    prompts = prompts.tolist()
    counts = param_counts(model)
    print(
        f"{describe(config, args.family)}: {counts['num_params'] / 1e9:.3f} B params, "
        f"{counts['active_params_per_token'] / 1e9:.3f} B active per token; {device}"
    )

    weights, rows = [], []
    if args.hf:
        rows += hf_decode_rows(model, prompts, device, args)
    for preset in args.presets:
        info, preset_rows = bench_preset(model, preset, device, prompts, args)
        weights.append(info)
        rows += preset_rows
    add_ratios(weights, rows)
    add_hf_ratios(rows)
    del model

    env = environment() if device.type == "cuda" else cpu_environment()
    copy = copy_bandwidth(torch.empty(64 << 20, device=device)) if device.type == "cuda" else None
    if copy is not None:
        for r in rows:
            r["weight_bw_vs_copy"] = r.get("weight_gbps") and r["weight_gbps"] / copy["gbps"]
            add_floor_ms(r, copy["gbps"])
    print(f"\n{env['device']}  torch {env['torch']}  backend {weights[0]['backend']}\n")
    print_tables(weights, rows)
    if copy is not None:
        print(f"copy bandwidth (read + write) this run: {copy['gbps']:.0f} GB/s")

    section = {
        "model": model_section(config, args, counts),
        "settings": {
            "device": str(device),
            "compute_dtype": "bfloat16",
            "prompt_tokens": args.prompt,
            "new_tokens": args.new_tokens,
            "batches": args.batch,
            "repeats": args.repeats,
            "sampling": "greedy (temperature 0)",
            "quick": args.quick,
            "tiny": args.tiny,
        },
        "weights": weights,
        "rows": rows,
        "copy_gbps_this_run": None if copy is None else copy["gbps"],
        "method": (
            "engine built by Engine.from_records(export_weights(master, plan)); weights: "
            "cuda.memory_allocated delta over the load, distinct storages the engine holds, and "
            "contract (exported) bytes; decode: wall clock between cuda.synchronize, one warm-up, "
            "median over repeats, ms/step = (t(N new) - t(1 new)) / (N - 1); weight GB/s = "
            "contract bytes one decode step reads (dense weights without the embedding + routed "
            "experts active in the batch at that step) / step time; floor: those weight bytes "
            "+ the K/V bytes attention reads at that step (as the engine caches them: for MLA "
            "the expanded per-head K/V; *_latent: a latent cache of kv_lora_rank + rope dim) "
            "over the copy bandwidth; hf rows: transformers generate on the same weights (bf16)"
        ),
    }
    if out is None:
        print("\n(no --out given on the CPU: results not written)")
        return 0
    update_results(Path(out), section_name(args.family), section, env)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
