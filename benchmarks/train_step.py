"""One training step (forward + backward) per preset against a HF transformers training step of the
same model, in one run: s/step, x our bf16, peak GPU memory, model TFLOP/s (issue 14).

    python benchmarks/train_step.py                       # H200: 4-layer Qwen3-30B-A3B slice
    python benchmarks/train_step.py --tiny --device cpu   # the script's logic, in seconds
    python benchmarks/train_step.py --family deepseek-v3 --layers 4 --shapes 4x1024 \
        --presets bf16 fp8-block                          # H200: Moonlight-shaped, ~1.5 min

Model: Qwen3-30B-A3B's layer shapes (benchmarks/families.py), `--layers` layers, vocab
32000, seeded random weights, fp32 master weights (`build_model`), `apply_plan(preset)`, bf16
compute (`CausalLM.set_training_options(compute_dtype=bf16)`), the GEMMs the device gets by
default (`mxrl.kernels.Kernels.resolve`: tensor cores on an sm_90 GPU) or `--gemm`. A step is
`cross_entropy(model(ids).float(), targets).backward()` on B x S random tokens, gradients set to
None between steps, or with `--optimizer` the trainers' fused AdamW step after it (the full
trainer step; the HF rows' AdamW on their own parameters: fp32, or bf16 with no master).
`--breakdown` profiles one step per mxrl preset and splits its GPU time by operation
(benchmarks/step_breakdown.py). `--micro-batches K`: a step is K forward + backward passes of
the B x S tokens (gradients accumulated) before the optimizer, as an RL step's training pass
runs (tokens and TFLOP/s count all K). `--bf16-weights`: the routed experts' bf16 GEMMs read a
copy of the master held from one optimizer step to the next (`held`, the trainer's default,
`rl.hold_bf16_weights`) or cast for each forward and dgrad (`cast`). Timed: median of
`--repeats` steps after `--warmup` steps (weight quantization, autotuning, allocator), twice:
with the quantized weights cached (the micro-batches after the first of one optimizer step), and
"fresh": every step the first after an optimizer step (`mxrl.nn.weights_changed()` before it, as
the optimizer's post-step hook calls it), so the step quantizes every weight, as each RL step does
when one optimizer step follows each batch.
"host s": the time until step() returns, before the final sync (the host's launches: a step
whose host time reaches its s/step is bound by Python and launches, not by the GPU).
Peak memory: `torch.cuda.max_memory_allocated` over the timed steps (parameters and gradients
included). HF peer: the same weights through `save_pretrained`, `AutoModelForCausalLM` with
`experts_implementation="grouped_mm"`, (a) fp32 parameters under bf16 autocast and (b) bf16
parameters. Writes the `train_step` section of the results JSON.

`--family deepseek-v3`: a DeepSeek-V3 slice with Moonlight-16B-A3B's layers (families.py:
MLA, the first layer dense, 64 experts top-6 and 2 shared experts; `--tiny`: its tiny layer,
block-FP8 ready), the HF peer transformers' `DeepseekV3ForCausalLM` loaded the same way (if it
refuses grouped_mm experts at load, the eager loop, named in the row's
`experts_implementation`), rows in the `train_step_deepseek_v3` section (the Qwen section kept).
Every preset keeps MLA, the routers and the shared experts bf16 (docs/models.md). TFLOP/s there
counts 6 x the parameters a token uses (less the embedding) x tokens, plus causal attention with
keys of qk_nope + qk_rope and values of v_head_dim. The slice's parameter count and the count
active per token are printed at the start.
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
    ensure_repo_on_path,
    environment,
    format_table,
    load_hf,
    update_results,
)
from engine_decode import check_device, check_presets, cpu_environment
from families import FAMILIES, describe, model_config, param_counts
from step_breakdown import OPTIMIZER_RANGE, profile_breakdown, profile_step, sync_device

ensure_repo_on_path()

from mxrl.arch import ModelConfig  # noqa: E402
from mxrl.kernels import Kernels  # noqa: E402
from mxrl.models import build_model, empty_model, save_pretrained  # noqa: E402
from mxrl.nn import apply_plan, set_gemm, weights_changed  # noqa: E402
from mxrl.recipe import resolve  # noqa: E402

DEFAULT_PRESETS = (
    "bf16",
    "fp8-block",
    "fp8-block-quantized",
    "mxfp8",
    "mxfp8-hp",
    "nvfp4-hp",
    "nvfp4-dequantized",
)
BASELINE = "bf16"
TINY_LAYER = {  # --tiny: every preset's shapes fit (fp8_block needs multiples of 128)
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "rope_theta": 10_000.0,
    "rms_norm_eps": 1e-6,
}


def step_flops(config: ModelConfig, batch: int, seq: int, active: int | None = None) -> float:
    """Useful GEMM FLOPs of forward + backward: 6 x active matmul parameters x tokens, plus
    causal attention (QK^T and PV: 2 x 2 x S^2/2 x N x D per sequence and layer, x3). MLA
    (`active`: the parameters one token uses, `families.param_counts`): its matmul parameters
    are those less the embedding table, and its scores have keys of qk_nope + qk_rope and
    values of v_head_dim."""
    c = config
    if c.is_mla:
        params = active - c.vocab_size * c.hidden_size  # the embedding is a gather
        dims = c.qk_nope_head_dim + c.head_dim + c.v_head_dim
        scores = 3 * seq * seq * c.num_attention_heads * dims * c.num_hidden_layers * batch
        return 6.0 * params * batch * seq + scores
    attn = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    attn += c.num_attention_heads * c.head_dim * c.hidden_size
    experts = c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size
    router = c.hidden_size * c.num_experts
    params = c.num_hidden_layers * (attn + experts + router) + c.hidden_size * c.vocab_size
    tokens = batch * seq
    scores = 3 * 2 * seq * seq * c.num_attention_heads * c.head_dim * c.num_hidden_layers * batch
    return 6.0 * params * tokens + scores


# dense bf16 tensor-core peaks in TFLOP/s (SXM, no sparsity), by device name: the MFU's
# denominator (the model FLOPs of `step_flops` over it)
DENSE_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}


def dense_bf16_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DENSE_BF16_TFLOPS.items() if k in name), None)


def measure(step, device: torch.device, warmup: int, repeats: int) -> dict:
    for _ in range(warmup):
        step()
    sync_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, host = [], []
    for _ in range(repeats):
        sync_device(device)
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)  # the host's launches (no sync in the step)
        sync_device(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "s_step": statistics.median(times),
        "times_s": times,
        "host_s": statistics.median(host),
        "peak_bytes": peak,
    }


def make_step(
    model,
    ids: torch.Tensor,
    autocast: torch.dtype | None,
    hf: bool = False,
    optimizer=None,
    micro_batches: int = 1,
):
    """`micro_batches` x (forward, loss, backward); then `optimizer`'s step (inside the
    breakdown's optimizer range) and its zero_grad, or without one the gradients set to None."""
    from torch.profiler import record_function

    inputs, targets = ids[:, :-1], ids[:, 1:].reshape(-1)

    def step():
        for _ in range(micro_batches):
            with torch.autocast(
                ids.device.type, dtype=autocast or torch.bfloat16, enabled=bool(autocast)
            ):
                out = model(input_ids=inputs) if hf else model(inputs)
                logits = out.logits if hf else out
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets)
            loss.backward()
            del out, logits
        if optimizer is None:
            for p in model.parameters():
                p.grad = None
            return loss
        with record_function(OPTIMIZER_RANGE):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def _optimizer(model, args):
    """`--optimizer`: the trainers' AdamW (fused) on the model's parameters (fp32 masters for
    mxrl and HF's autocast row, bf16 for HF's bf16 row), a learning rate too small to matter."""
    if not args.optimizer:
        return None
    from mxrl.rl.optim import adamw

    return adamw([p for p in model.parameters() if p.requires_grad], lr=1e-7)


def mxrl_row(base_state, config, preset, ids, device, args) -> dict:
    model = empty_model(config, device=device)
    model.load_state_dict(base_state)
    plan = resolve(preset, {n: p.shape for n, p in model.named_parameters()})
    apply_plan(model, plan)
    if args.gemm:
        set_gemm(model, args.gemm)
    compute = None if args.compute == "fp32" else torch.bfloat16
    model.set_training_options(
        compute_dtype=compute,
        checkpoint_layers=args.checkpoint_layers,
        hold_bf16_weights=args.bf16_weights == "held",
    )
    model.train()
    step = make_step(
        model, ids, None, optimizer=_optimizer(model, args), micro_batches=args.micro_batches
    )
    got = measure(step, device, args.warmup, args.repeats)

    def fresh_step():
        weights_changed()  # what the optimizer's post-step hook does
        return step()

    if not args.optimizer:  # with it, every step is the first after an optimizer step
        fresh = measure(fresh_step, device, 1, args.repeats)
        got.update(s_step_fresh=fresh["s_step"], peak_bytes_fresh=fresh["peak_bytes"])
    if args.profile:
        got["profile"] = profile_step(step, device, f"{preset} {tuple(ids.shape)}", args.profile)
    if args.breakdown:
        got["breakdown_ms"] = profile_breakdown(step, model, device)
        print(f"  {preset} {tuple(ids.shape)} by operation (ms): " + ", ".join(
            f"{k} {v:.1f}" for k, v in got["breakdown_ms"].items()))  # fmt: skip
    del model
    _free(device)
    return {"impl": "mxrl", "preset": preset, **got}


def hf_rows(path: Path, ids: torch.Tensor, device, args) -> list[dict]:
    import transformers

    rows = []
    for name, dtype, autocast in (
        ("hf fp32+autocast", torch.float32, torch.bfloat16),
        ("hf bf16", torch.bfloat16, None),
    ):
        model, impl = load_hf(path, dtype)
        model = model.to(device).train()
        optimizer = _optimizer(model, args)
        step = make_step(
            model, ids, autocast, hf=True, optimizer=optimizer, micro_batches=args.micro_batches
        )
        got = measure(step, device, args.warmup, args.repeats)
        version = transformers.__version__
        rows.append({"impl": name, "preset": name, "experts_implementation": impl,
                     "transformers": version, **got})  # fmt: skip
        print(f"  {name} ({impl}) {tuple(ids.shape)}: {got['s_step']:.3f} s/step")
        del model
        _free(device)
    return rows


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    ap.add_argument(
        "--family", choices=FAMILIES, default="qwen3-moe", help="benchmarks/families.py"
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shapes", nargs="+", default=["4x1024", "16x1024"], help="BxS token shapes")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gemm", choices=["reference", "tensor_core"], help="default: by device")
    ap.add_argument("--compute", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--checkpoint-layers", action="store_true", help="activation checkpointing")
    ap.add_argument("--tiny", action="store_true", help="tiny layer shapes (the logic on a CPU)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TOP",
        help="profile one step per preset and print its TOP kernels",
    )
    ap.add_argument(
        "--optimizer",
        action="store_true",
        help="each step ends with the trainers' fused AdamW step (the full trainer step)",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="profile one step per mxrl preset: ms by operation (benchmarks/step_breakdown.py)",
    )
    ap.add_argument(
        "--micro-batches", type=int, default=1, help="forward + backward passes per step"
    )
    ap.add_argument(
        "--bf16-weights",
        choices=["held", "cast"],
        default="held",
        help="the bf16 experts' copy of the master: held per optimizer step, or cast per GEMM",
    )
    ap.add_argument("--out", help="results JSON (default on CUDA: benchmarks/results/h200.json)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.vocab = min(args.vocab, 256)
        if args.shapes == ap.get_default("shapes"):
            args.shapes = ["2x16"]
    try:
        args.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    except ValueError:
        ap.error(f"--shapes takes BxS pairs such as 4x1024, got {args.shapes}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    check_presets(args.presets)
    device = check_device(args.device)
    qwen = args.family == "qwen3-moe"
    config = model_config(
        layers=args.layers,
        vocab=args.vocab,
        tiny=args.tiny,
        tiny_layer=TINY_LAYER if qwen else None,  # DeepSeek's tiny layer is block-FP8 ready
        family=args.family,
    )
    base = build_model(config, seed=0)  # fp32 master weights, drawn on the CPU
    base_state = {k: v.detach() for k, v in base.state_dict().items()}
    counts = param_counts(base)
    gemm = args.gemm or Kernels.resolve(None, device).train_gemm.value
    print(
        f"{describe(config, args.family)}: {counts['num_params'] / 1e9:.3f} B params, "
        f"{counts['active_params_per_token'] / 1e9:.3f} B active per token"
    )
    print(f"device {device}, gemm {gemm}, compute {args.compute}")
    peak = dense_bf16_peak(device)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_hf:
            save_pretrained(base, tmp)
        del base
        for b, s in args.shapes:
            gen = torch.Generator().manual_seed(b * 100003 + s)
            ids = torch.randint(1, config.vocab_size, (b, s + 1), generator=gen).to(device)
            flops = args.micro_batches * step_flops(config, b, s, counts["active_params_per_token"])
            shape_rows = [] if args.skip_hf else hf_rows(Path(tmp), ids, device, args)
            for preset in args.presets:
                row = mxrl_row(base_state, config, preset, ids, device, args)
                print(f"  {preset} {b}x{s}: {row['s_step']:.3f} s/step")
                shape_rows.append(row)
            for row in shape_rows:
                row.update(B=b, S=s, tokens=args.micro_batches * b * s)
                row.update(micro_batches=args.micro_batches, tflops=flops / row["s_step"] / 1e12)
                row["mfu"] = row["tflops"] / peak if peak else None
            _ratios(shape_rows)
            rows += shape_rows
    print(format_table(rows, [
        ("preset", "run", ""), ("B", "B", "d"), ("S", "S", "d"), ("s_step", "s/step", ".3f"),
        ("x_bf16", "x bf16 time", ".2f"), ("x_hf_bf16", "x HF bf16", ".2f"), ("peak_gb", "peak GB", ".1f"),
        ("mem_x_bf16", "x bf16 mem", ".2f"), ("tflops", "TFLOP/s", ".1f"), ("mfu", "MFU", ".3f"),
        ("host_s", "host s", ".3f"), ("s_step_fresh", "fresh s/step", ".3f"),
        ("x_bf16_fresh", "fresh x bf16", ".2f"), ("peak_gb_fresh", "fresh GB", ".1f"),
        ("mem_x_bf16_fresh", "fresh x mem", ".2f"),
        ("bf16_x_hf_autocast", "bf16 x HF(amp)", ".2f"), ("bf16_x_hf_bf16", "bf16 x HF(bf16)", ".2f"),
    ]))  # fmt: skip
    env = environment() if device.type == "cuda" else cpu_environment()
    section = {
        "model": {"layers": args.layers, "vocab": args.vocab, "tiny": args.tiny}
        | ({} if qwen else {"family": args.family, **counts}),
        "gemm": gemm,
        "compute": args.compute,
        "checkpoint_layers": args.checkpoint_layers,
        "bf16_weights": args.bf16_weights,
        "micro_batches": args.micro_batches,
        "optimizer": "adamw fused (mxrl.rl.optim)" if args.optimizer else None,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "rows": rows,
    }
    out = args.out or (
        str(REPO_ROOT / "benchmarks/results/h200.json") if device.type == "cuda" else None
    )
    if out:
        name = "train_step" if qwen else "train_step_deepseek_v3"  # neither overwrites the other
        update_results(Path(out), name, {**section, "environment": env}, {})
        print(f"wrote the {name} section of {out}")
    return 0


def _ratios(rows: list[dict]) -> None:
    """x bf16 (time and memory, ours), and our bf16 time over each HF variant's (< 1: faster)."""
    by = {r["preset"]: r for r in rows}
    base = by.get(BASELINE)
    for r in rows:
        r["peak_gb"] = None if r["peak_bytes"] is None else r["peak_bytes"] / 1e9
        r["x_bf16"] = r["s_step"] / base["s_step"] if base else None
        both = base and r["peak_bytes"] and base["peak_bytes"]
        r["mem_x_bf16"] = r["peak_bytes"] / base["peak_bytes"] if both else None
    for r in rows:  # every step the first after an optimizer step (mxrl rows only)
        fresh, base_fresh = r.get("s_step_fresh"), base and base.get("s_step_fresh")
        r["x_bf16_fresh"] = fresh / base_fresh if fresh and base_fresh else None
        peak, base_peak = r.get("peak_bytes_fresh"), base and base.get("peak_bytes_fresh")
        r["peak_gb_fresh"] = peak / 1e9 if peak else None
        r["mem_x_bf16_fresh"] = peak / base_peak if peak and base_peak else None
    for key, name in (("bf16_x_hf_autocast", "hf fp32+autocast"), ("bf16_x_hf_bf16", "hf bf16")):
        if base and name in by:
            base[key] = base["s_step"] / by[name]["s_step"]
    hf = by.get("hf bf16")
    for r in rows:  # every row's time over HF's bf16-parameter step (issue 29's x_hf_bf16)
        r["x_hf_bf16"] = r["s_step"] / hf["s_step"] if hf else None


if __name__ == "__main__":
    raise SystemExit(main())
