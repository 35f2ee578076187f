"""Rollout against HF transformers `generate`: decode ms per step and tokens/s of the mxrl engine
per preset and of HF `generate` (experts_implementation="grouped_mm") on the same model, the same
weights and the same prompts, with the weight-read floor of the same run.

    python benchmarks/rollout.py                     # H200: 4-layer Qwen3-30B-A3B slice
    python benchmarks/rollout.py --tiny --device cpu # the script's logic, in seconds
    python benchmarks/rollout.py --rl                # + the RL-shaped run (GRPO groups)

Engine modes (`--modes`): `invariant` (the default engine: batch-invariant, CUDA-graph decode),
`fast` (batch_invariant=False: no fixed-shape tiles; the cost of invariance is its ratio to
`invariant`), `eager` (invariant, no CUDA graphs: what the graphs buy), `stepwise` (invariant,
overlap=False: each decode step read back before the next is queued; what overlapped decoding
buys), `grouped` (invariant, `dense_gemm="grouped"`: each bf16 projection's rows in one launch
instead of one per 128-row tile; what that buys in prefill).

RL-shaped (`--rl`): `--groups` prompts x `--samples` samples each (GRPO groups, sharing their
prompt's KV blocks), prompt `--rl-prompt` tokens, sampled at temperature 1, up to
`--rl-new-tokens` new tokens. The model has random weights, so no token is an end of text by
itself: a fixed set of vocab/`--eos-every` token ids is declared as stop tokens, to both HF and
mxrl, which gives sequence lengths spread geometrically as real rollouts are (each side samples
its own tokens; the report gives the tokens each generated). tokens/s = generated tokens / wall
time of the whole call, prefill included; peak KV memory against the tokens it held then.

Model: Qwen3-30B-A3B's layer shapes (benchmarks/families.py), `--layers` layers, vocab
32000, seeded random weights, written once as a HF checkpoint that both sides load (transformers
in bf16; mxrl through `from_pretrained`, the engine computing in bf16). Decode step time is
(t(N new tokens) - t(1 new token)) / (N - 1), greedy, every request generating exactly N tokens
(HF: min_new_tokens = N); for mxrl, the engine's own clock gives it directly: the median wall
time of its decode steps (scheduling to tokens on the host; the difference is kept beside it).
Floor: the bytes a decode step must read (every dense weight, the
routed experts at least one request uses in that step, from the engine's routing record) over
the copy bandwidth measured in the same run. Writes the `rollout` section of the results JSON.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import (
    REPO_ROOT,
    copy_bandwidth,
    ensure_repo_on_path,
    environment,
    format_table,
    load_hf,
    update_results,
)
from engine_decode import (
    check_device,
    check_presets,
    cpu_environment,
    model_config,
    step_weight_bytes,
)

ensure_repo_on_path()

from mxrl.engine import Engine, SamplingParams  # noqa: E402
from mxrl.models import build_model, from_pretrained, save_pretrained  # noqa: E402
from mxrl.recipe import resolve  # noqa: E402
from mxrl.weights import export_weights  # noqa: E402

DEFAULT_PRESETS = ("bf16", "mxfp8", "nvfp4-dequantized")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocator, autotuning, compiled kernels
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_rows(path: Path, prompts: list[list[int]], device, args) -> tuple[list[dict], str]:
    model, impl = load_hf(path)
    model = model.to(device).eval()
    rows = []
    for b in args.batch:
        ids = torch.tensor(prompts[:b], device=device)
        mask = torch.ones_like(ids)

        def run(n, ids=ids, mask=mask):
            with torch.no_grad():
                return model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0,
                )  # fmt: skip

        t_n = _median_s(lambda: run(args.new_tokens), device, args.repeats)
        t_1 = _median_s(lambda: run(1), device, args.repeats)
        rows.append(_row("hf", b, t_n, t_1, args))
        print(f"  hf ({impl}) B={b}: {rows[-1]['ms_step']:.2f} ms/step")
    model.to("cpu")  # free the GPU for the engine (the name goes out of scope on return)
    gc.collect()
    return rows, impl


MODES = {
    "invariant": {},
    "fast": {"batch_invariant": False},
    "eager": {"cuda_graphs": False},
    "stepwise": {"overlap": False},
    "grouped": {"dense_gemm": "grouped"},
}


def make_engine(model, preset: str, device, mode: str) -> Engine:
    plan = resolve(preset, {n: p.shape for n, p in model.named_parameters()})
    return Engine.from_records(
        model.config, plan, export_weights(model.named_parameters(), plan),
        device=device, compute_dtype=torch.bfloat16, **MODES[mode],
    )  # fmt: skip


def drop_engine(engine: Engine, device) -> None:
    engine.net.to("meta")  # drop its weights before the next preset's engine
    engine._kv = engine._graphs = engine.runner = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def mxrl_rows(model, preset: str, mode: str, prompts, device, args):
    engine = make_engine(model, preset, device, mode)
    rows, floors = [], []
    for b in args.batch:
        batch = prompts[:b]

        def run(n, batch=batch):
            engine.reset_prefix_cache()  # prefill every prompt, as HF does
            return engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=n))

        t_n = _median_s(lambda: run(args.new_tokens), device, args.repeats)
        stats = engine.stats
        t_1 = _median_s(lambda: run(1), device, args.repeats)
        row = _row(preset, b, t_n, t_1, args)
        # the engine's own clock: median wall time of a decode step (scheduling, forward,
        # sampling, the host transfer), over the last timed call's decode steps
        row["ms_step_by_difference"] = row["ms_step"]
        row["ms_step"] = statistics.median(stats.decode_step_s) * 1e3
        row["tok_s"] = b / (row["ms_step"] * 1e-3)
        rows.append({**row, "mode": mode, "graph_steps": stats.graph_steps})
        floors.append(step_weight_bytes(engine, run(args.new_tokens), args.prompt))
        print(f"  {preset} [{mode}] B={b}: {rows[-1]['ms_step']:.2f} ms/step")
    drop_engine(engine, device)
    return rows, floors


def rl_prompts(config, args) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(1, config.vocab_size, (args.groups, args.rl_prompt), generator=gen)
    prompts = [p for p in base.tolist() for _ in range(args.samples)]
    stop = list(range(1, config.vocab_size, args.eos_every))
    return prompts, stop


def rl_mxrl_row(model, preset, mode, prompts, stop, device, args) -> dict:
    engine = make_engine(model, preset, device, mode)
    params = SamplingParams(
        temperature=1.0, max_new_tokens=args.rl_new_tokens, stop_token_ids=stop, seed=0
    )
    # every decode graph before the timed call (its batch shrinks through every size as
    # requests stop; an RL loop captures them in its first rollout and keeps them), then a
    # warm-up for compiled kernels
    engine.capture_graphs(args.rl_prompt + args.rl_new_tokens)
    engine.generate(prompts[: args.samples], params)
    engine.reset_prefix_cache()  # the warm-up's prompt is computed again, as HF does
    _sync(device)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync(device)
    wall = time.perf_counter() - start
    st = engine.stats
    kv_block_bytes = (
        engine._kv.k[0][0].numel() * engine._kv.k[0].element_size() * 2 * len(engine._kv.k)
    )
    tokens = sum(len(o.tokens) for o in outs)
    row = {
        "preset": preset, "mode": mode, "sequences": len(prompts), "generated_tokens": tokens,
        "mean_len": tokens / len(outs), "max_len": max(len(o.tokens) for o in outs),
        "wall_s": wall, "tok_s": tokens / wall, "steps": st.steps, "graph_steps": st.graph_steps,
        "peak_kv_blocks": st.peak_kv_blocks, "peak_kv_bytes": st.peak_kv_blocks * kv_block_bytes,
        "peak_kv_tokens_held": st.peak_kv_tokens,
        "peak_kv_bytes_per_token_held": st.peak_kv_blocks * kv_block_bytes
        / max(st.peak_kv_tokens, 1),
        "kv_bytes_per_token": kv_block_bytes / st.block_size,
    }  # fmt: skip
    print(
        f"  RL {preset} [{mode}]: {tokens} tokens in {wall:.1f} s = {row['tok_s']:.0f} tok/s; "
        f"{st.steps} steps ({st.graph_steps} graphs); peak KV {row['peak_kv_bytes'] / 2**20:.0f} "
        f"MiB for {st.peak_kv_tokens} tokens held"
    )
    drop_engine(engine, device)
    return row


def rl_hf_row(path: Path, prompts, stop, device, args) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, experts_implementation="grouped_mm"
    ).to(device)
    ids = torch.tensor(prompts, device=device)
    torch.manual_seed(0)

    def run(n):
        with torch.no_grad():
            return model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                do_sample=True, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=stop,
                pad_token_id=0,
            )  # fmt: skip

    run(2)  # warm-up
    _sync(device)
    start = time.perf_counter()
    out = run(args.rl_new_tokens)
    _sync(device)
    wall = time.perf_counter() - start
    new = out[:, ids.shape[1] :]
    stop_t = torch.tensor(stop, device=device)
    is_stop = torch.isin(new, stop_t)
    # a sequence's length: up to and including its first stop token (HF pads after it)
    first = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, new.shape[1])
    tokens = int(first.sum())
    model.to("cpu")
    gc.collect()
    print(f"  RL hf: {tokens} tokens in {wall:.1f} s = {tokens / wall:.0f} tok/s")
    return {
        "preset": "hf", "mode": "grouped_mm", "sequences": len(prompts),
        "generated_tokens": tokens, "mean_len": tokens / len(prompts),
        "max_len": int(first.max()), "wall_s": wall, "tok_s": tokens / wall,
    }  # fmt: skip


def _row(name: str, b: int, t_n: float, t_1: float, args) -> dict:
    ms_step = (t_n - t_1) / (args.new_tokens - 1) * 1e3
    return {
        "preset": name,
        "B": b,
        "ms_step": ms_step,
        "tok_s": b / (ms_step * 1e-3) if ms_step > 0 else None,
        "total_s": t_n,
        "prefill_plus_one_s": t_1,
    }


def _derive(rows: list[dict], rl_rows: list[dict]) -> None:
    """Ratios to HF, to our bf16 and of invariance, from the rows measured so far."""
    hf_ms = {r["B"]: r["ms_step"] for r in rows if r["preset"] == "hf"}
    bf16_ms = {(r["B"], r.get("mode")): r["ms_step"] for r in rows if r["preset"] == "bf16"}
    inv_ms = {(r["preset"], r["B"]): r["ms_step"] for r in rows if r.get("mode") == "invariant"}
    for r in rows:
        key = (r["B"], r.get("mode"))
        r["ratio_to_hf"] = hf_ms[r["B"]] / r["ms_step"] if r["B"] in hf_ms else None
        r["speed_vs_mxrl_bf16"] = bf16_ms[key] / r["ms_step"] if key in bf16_ms else None
        if r.get("mode") == "fast" and (r["preset"], r["B"]) in inv_ms:
            r["invariance_cost"] = inv_ms[(r["preset"], r["B"])] / r["ms_step"] - 1
    hf_rl = next((r["tok_s"] for r in rl_rows if r["preset"] == "hf"), None)
    for r in rl_rows:
        r["ratio_to_hf"] = r["tok_s"] / hf_rl if hf_rl else None


def add_rl_shape_arguments(ap: argparse.ArgumentParser) -> None:
    """The RL-shaped run's shape (module doc; `rl_prompts`), shared with profile_generate.py."""
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--rl-prompt", type=int, default=256)
    ap.add_argument("--rl-new-tokens", type=int, default=2048)
    ap.add_argument("--eos-every", type=int, default=1000)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    ap.add_argument("--modes", nargs="+", default=["invariant"], choices=sorted(MODES))
    ap.add_argument("--rl", action="store_true", help="also the RL-shaped run (module doc)")
    ap.add_argument("--rl-only", action="store_true", help="only the RL-shaped run")
    add_rl_shape_arguments(ap)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny layer shapes (the logic on a CPU)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", help="results JSON (default on CUDA: benchmarks/results/h200.json)")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (a decode step is timed as t_N - t_1)")
    args.batch = sorted(set(args.batch))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    check_presets(args.presets)
    device = check_device(args.device)
    if args.tiny:
        args.vocab = min(args.vocab, 128)
    config = model_config(layers=args.layers, vocab=args.vocab, tiny=args.tiny)
    model = build_model(config, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, config.vocab_size, (max(args.batch), args.prompt), generator=gen)
    prompts = prompts.tolist()
    bandwidth = (
        copy_bandwidth(torch.empty(1 << 28, device=device)) if device.type == "cuda" else None
    )
    rows: list[dict] = []
    rl_rows: list[dict] = []
    rl_in, stop = rl_prompts(config, args)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        hf_impl = None
        if not args.skip_hf and not args.rl_only:
            hf, hf_impl = hf_rows(Path(tmp), prompts, device, args)
            rows += hf
        if not args.skip_hf and (args.rl or args.rl_only) and device.type == "cuda":
            rl_rows.append(rl_hf_row(Path(tmp), rl_in, stop, device, args))
        loaded = from_pretrained(tmp, dtype=torch.float32)
    env = environment() if device.type == "cuda" else cpu_environment()
    out = args.out or (
        str(REPO_ROOT / "benchmarks/results/h200.json") if device.type == "cuda" else None
    )

    def write(final: bool) -> None:
        """Derived ratios, then the section — after every block of rows, so a run cut short
        (a time limit) keeps what it measured (`complete` says whether it finished)."""
        _derive(rows, rl_rows)
        section = {
            "model": {"layers": args.layers, "vocab": args.vocab, "tiny": args.tiny},
            "prompt": args.prompt, "new_tokens": args.new_tokens,
            "hf_experts_implementation": hf_impl, "copy_bandwidth": bandwidth,
            "rows": rows, "complete": final,
            "rl": {
                "groups": args.groups, "samples": args.samples, "prompt": args.rl_prompt,
                "max_new_tokens": args.rl_new_tokens, "stop_tokens": len(stop),
                "rows": rl_rows,
            } if rl_rows else None,
        }  # fmt: skip
        if out:
            update_results(Path(out), "rollout", {**section, "environment": env}, {})

    write(final=False)
    for preset in args.presets:
        for mode in args.modes if not args.rl_only else []:
            got, floors = mxrl_rows(loaded, preset, mode, prompts, device, args)
            for row, step_bytes in zip(got, floors, strict=True):
                row["step_bytes"] = step_bytes
                if bandwidth is not None:
                    floor_ms = step_bytes / (bandwidth["gbps"] * 1e9) * 1e3
                    row["floor_ms"] = floor_ms
                    row["ratio_to_floor"] = row["ms_step"] / floor_ms
            rows += got
            write(final=False)
        if args.rl or args.rl_only:
            rl_rows.append(rl_mxrl_row(loaded, preset, "invariant", rl_in, stop, device, args))
            write(final=False)
    write(final=True)
    if rows:
        print(format_table(rows, [
            ("preset", "preset", ""), ("mode", "mode", ""), ("B", "B", "d"),
            ("ms_step", "ms/step", ".2f"), ("tok_s", "tok/s", ".0f"),
            ("ratio_to_hf", "x HF", ".2f"), ("speed_vs_mxrl_bf16", "x bf16", ".2f"),
            ("ratio_to_floor", "x floor", ".1f"),
        ]))  # fmt: skip
    if rl_rows:
        print(format_table(rl_rows, [
            ("preset", "preset", ""), ("generated_tokens", "tokens", "d"),
            ("wall_s", "s", ".1f"), ("tok_s", "tok/s", ".0f"), ("ratio_to_hf", "x HF", ".2f"),
            ("peak_kv_bytes_per_token_held", "KV B/token held", ".0f"),
        ]))  # fmt: skip
    if out:
        print(f"wrote the rollout section of {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
