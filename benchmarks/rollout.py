"""Rollout against HF transformers `generate`: decode ms per step and tokens/s of the mxrl engine
per preset and of HF `generate` (experts_implementation="grouped_mm") on the same model, the same
weights and the same prompts, with the weight-read floor of the same run.

    python benchmarks/rollout.py                     # H200: 4-layer Qwen3-30B-A3B slice
    python benchmarks/rollout.py --tiny --device cpu # the script's logic, in seconds

Model: Qwen3-30B-A3B's layer shapes (benchmarks/engine_decode.py), `--layers` layers, vocab
32000, seeded random weights, written once as a HF checkpoint that both sides load (transformers
in bf16; mxrl through `from_pretrained`, the engine computing in bf16). Decode step time is
(t(N new tokens) - t(1 new token)) / (N - 1), greedy, every request generating exactly N tokens
(HF: min_new_tokens = N). Floor: the bytes a decode step must read (every dense weight, the
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

from mxrl.engine import Engine, SamplingParams, export_weights  # noqa: E402
from mxrl.models import build_model, from_pretrained, save_pretrained  # noqa: E402
from mxrl.recipe import resolve  # noqa: E402

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
    import transformers

    kwargs = {"dtype": torch.bfloat16, "experts_implementation": "grouped_mm"}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        impl = "grouped_mm"
    except (TypeError, ValueError) as err:
        print(f"  (transformers refused experts_implementation=grouped_mm: {err}; eager)")
        kwargs.pop("experts_implementation")
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        impl = "eager"
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


def mxrl_rows(model, preset: str, prompts, device, args) -> tuple[list[dict], list[float]]:
    plan = resolve(preset, {n: p.shape for n, p in model.named_parameters()})
    engine = Engine.from_records(
        model.config, plan, export_weights(model.named_parameters(), plan),
        device=device, compute_dtype=torch.bfloat16,
    )  # fmt: skip
    rows, floors = [], []
    for b in args.batch:
        batch = prompts[:b]

        def run(n, batch=batch):
            return engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=n))

        t_n = _median_s(lambda: run(args.new_tokens), device, args.repeats)
        t_1 = _median_s(lambda: run(1), device, args.repeats)
        rows.append(_row(preset, b, t_n, t_1, args))
        floors.append(step_weight_bytes(engine, run(args.new_tokens), args.prompt))
        print(f"  {preset} B={b}: {rows[-1]['ms_step']:.2f} ms/step")
    engine.net.to("meta")  # drop its weights before the next preset's engine
    engine._kv = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, floors


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


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
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
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        hf_impl = None
        if not args.skip_hf:
            hf, hf_impl = hf_rows(Path(tmp), prompts, device, args)
            rows += hf
        loaded = from_pretrained(tmp, dtype=torch.float32)
    for preset in args.presets:
        got, floors = mxrl_rows(loaded, preset, prompts, device, args)
        for row, step_bytes in zip(got, floors, strict=True):
            row["step_bytes"] = step_bytes
            if bandwidth is not None:
                floor_ms = step_bytes / (bandwidth["gbps"] * 1e9) * 1e3
                row["floor_ms"] = floor_ms
                row["ratio_to_floor"] = row["ms_step"] / floor_ms
        rows += got
    hf_ms = {r["B"]: r["ms_step"] for r in rows if r["preset"] == "hf"}
    bf16_ms = {r["B"]: r["ms_step"] for r in rows if r["preset"] == "bf16"}
    for r in rows:
        r["ratio_to_hf"] = hf_ms[r["B"]] / r["ms_step"] if r["B"] in hf_ms else None
        r["speed_vs_mxrl_bf16"] = bf16_ms[r["B"]] / r["ms_step"] if r["B"] in bf16_ms else None
    print(format_table(rows, [
        ("preset", "preset", ""), ("B", "B", "d"), ("ms_step", "ms/step", ".2f"),
        ("tok_s", "tok/s", ".0f"), ("ratio_to_hf", "x HF", ".2f"),
        ("speed_vs_mxrl_bf16", "x bf16", ".2f"), ("ratio_to_floor", "x floor", ".1f"),
    ]))  # fmt: skip
    env = environment() if device.type == "cuda" else cpu_environment()
    section = {
        "model": {"layers": args.layers, "vocab": args.vocab, "tiny": args.tiny},
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "hf_experts_implementation": hf_impl,
        "copy_bandwidth": bandwidth,
        "rows": rows,
    }
    out = args.out or (
        str(REPO_ROOT / "benchmarks/results/h200.json") if device.type == "cuda" else None
    )
    if out:
        update_results(Path(out), "rollout", {**section, "environment": env}, {})
        print(f"wrote the rollout section of {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
