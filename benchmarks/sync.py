"""Weight sync trainer -> engine in one process: seconds and GB/s per sync, per preset.

Seconds per sync and GB/s of engine bytes per preset, against the device's copy bandwidth
measured in the same run (issue 13). The two-GPU sync over NCCL is benchmarks/sync_nccl.py,
which imports its model, timing and rows from here.

    python benchmarks/sync.py                                   # H200: in-process, one GPU
    python benchmarks/sync.py --tiny --device cpu               # the script's logic, in seconds

Model: Qwen3-30B-A3B's layer shapes (benchmarks/families.py), `--layers` layers (4), vocab
151936, seeded fp32 master weights on the device. A sync is what the GRPO loop runs after each
optimizer step: `InProcessTransport(engine).send(export(model, plan, step=s))`, trainer and
engine on the same GPU (the engine computing in bf16, its default backend).
Timed with the device synchronized before and after, the median of `--repeats` after a warm-up.

Per preset: seconds per sync (with the per-layer SQNR off, and on as the loop runs it), GB/s of
engine bytes (every record's data, scales and global scales), the byte floor (the masters read
twice, the engine bytes written, checksummed twice and copied in: `byte_floor`, 2 M + 5 E bytes
at the copy bandwidth) and the sync's time over it, the ratio to the copy bandwidth (a
device-to-device `copy_` counting bytes read + written), the peak memory the sync allocates
beyond what trainer and engine hold, and the share of each stage, each timed alone and
synchronized: quantize (`quantized_values`), checksum (twice: once on send, once on receive),
transfer (in-process: none, records are handed over by reference) and load (`load_weights` of
records verified already, as the distributed receiver hands them: the copy into the engine's
buffers and the GEMM operands derived from them).
The 48-layer row scales the sync time by the engine bytes of a 48-layer plan (resolved on the
full model's shapes, bytes per format by formula).
Writes the `sync` section of the results JSON.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from common import (
    REPO_ROOT,
    copy_bandwidth,
    ensure_repo_on_path,
    environment,
    profile_call,
    update_results,
)
from engine_decode import (
    QWEN3_30B_A3B_LAYER,
    check_device,
    check_presets,
    cpu_environment,
    model_config,
)

ensure_repo_on_path()

from mxrl.arch import ModelConfig  # noqa: E402
from mxrl.engine import Engine  # noqa: E402
from mxrl.formats.constants import Format  # noqa: E402
from mxrl.models import CausalLM, build_model  # noqa: E402
from mxrl.recipe import resolve  # noqa: E402
from mxrl.sync import InProcessTransport  # noqa: E402
from mxrl.weights import (  # noqa: E402
    WeightRecord,
    checksums,
    export,
    quantized_values,
    verified_records,
)
from mxrl.weights.event import SqnrSample  # noqa: E402

DEFAULT_PRESETS = ("bf16", "mxfp8", "nvfp4-dequantized", "fp8-block")
FULL_LAYERS = 48
LOOP_SQNR_STRIDE = 16  # rl.sqnr_expert_stride's default
VOCAB = 151936
TINY_LAYER = {  # --tiny: every preset applies (block FP8 needs K % 128 == 0), seconds on a CPU
    **QWEN3_30B_A3B_LAYER,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
}


def config_of(layers: int, vocab: int, tiny: bool) -> ModelConfig:
    return model_config(layers=layers, vocab=vocab, tiny=tiny, tiny_layer=TINY_LAYER)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, *, warmup: bool = True) -> float:
    """Median seconds of fn(), the device synchronized around each call."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_extra(fn, device: torch.device) -> int | None:
    """Bytes fn() allocates at its peak beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        fn()
        return None
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def spec_bytes(spec) -> int:
    """Engine bytes of one tensor of a plan, by format (QTensor layouts, mxrl/formats/qtensor.py)."""
    n = 1
    for d in spec.shape:
        n *= d
    lead = n // spec.shape[-1]
    k = spec.shape[-1]
    if spec.format is Format.BF16:
        return 2 * n
    if spec.format is Format.MXFP8:
        return n + lead * (k // 32)
    if spec.format is Format.NVFP4:
        experts = spec.shape[0] if len(spec.shape) == 3 else 1
        rows = spec.shape[1] if spec.role == "gate_up" and spec.fuse_group is None else 1
        return n // 2 + lead * (k // 16) + 4 * experts * (rows if experts > 1 else 1)
    br, bk = spec.block or (128, 128)
    rows = spec.shape[-2] if len(spec.shape) >= 2 else 1
    mats = n // (rows * k)
    return n + 4 * mats * (-(-rows // br) if br > 1 else rows) * (k // bk)


def plan_bytes(config: ModelConfig, preset: str) -> int:
    with torch.device("meta"):
        model = CausalLM(config)
    plan = resolve(preset, {n: p.shape for n, p in model.named_parameters()})
    return sum(spec_bytes(spec) for spec in plan.values())


def breakdown(model, engine: Engine, device, repeats: int) -> dict:
    """Each stage alone, synchronized (module docstring)."""
    plan = engine.plan
    holder: dict = {}

    def quantize():
        holder["values"] = list(quantized_values(model.named_parameters(), plan))

    t_quantize = timed(quantize, device, repeats)
    values = holder["values"]
    names, tensors = [n for n, _ in values], [v for _, v in values]
    t_checksum = timed(lambda: checksums(names, tensors), device, repeats)
    sums = checksums(names, tensors)
    records = [WeightRecord(n, v, s) for (n, v), s in zip(values, sums, strict=True)]
    verified = verified_records(records, sums)  # what the distributed receiver hands over
    t_load = timed(lambda: engine.load_weights(verified, plan.hash()), device, repeats)
    t_load_checked = timed(lambda: engine.load_weights(records, plan.hash()), device, repeats)
    return {
        "quantize_s": t_quantize,
        "checksum_s": t_checksum,  # one pass; a sync runs two (send, receive)
        "load_s": t_load,
        "load_with_checksum_s": t_load_checked,
    }


def shares(stages: dict, transfer_s: float) -> dict:
    parts = {
        "quantize": stages["quantize_s"],
        "checksum": 2 * stages["checksum_s"],
        "transfer": transfer_s,
        "load": stages["load_s"],
    }
    total = sum(parts.values())
    return {k: (v / total if total > 0 else None) for k, v in parts.items()}


def row_common(preset, engine, seconds, seconds_sqnr, stages, transfer_s, peak, base_bytes, args):
    engine_bytes = sum(r.nbytes for r in engine.records())
    config = engine.config
    full = config_of(FULL_LAYERS, config.vocab_size, args.tiny)
    bytes_48 = plan_bytes(full, preset)
    return {
        "preset": preset,
        "engine_bytes": engine_bytes,
        "engine_bytes_formula": plan_bytes(config, preset),
        "num_tensors": len(engine.plan),
        "sync_s": seconds,
        "sync_with_sqnr_s": seconds_sqnr,
        "gbps": engine_bytes / seconds / 1e9,
        "ratio_to_baseline": engine_bytes / seconds / 1e9 / base_bytes,
        **stages,
        "transfer_s": transfer_s,
        "share": shares(stages, transfer_s),
        "verification_share": 2 * stages["checksum_s"] / seconds,
        "peak_extra_bytes": peak,
        "peak_extra_buckets": (peak / args.bucket_bytes) if peak is not None else None,
        "engine_bytes_48_layers": bytes_48,
        "sync_s_48_layers": seconds * bytes_48 / engine_bytes,
    }


def byte_floor(master_bytes: int, engine_bytes: int, copy_gbps: float) -> dict:
    """The in-process sync's byte floor: the masters read twice (the NaN/Inf check, or NVFP4's
    global amax, which is that check; then the quantizer or the bf16 cast), the engine bytes
    written once by the quantizer, read by the two checksums (sent, verified) and copied into
    the engine's buffers (read + write): 2 M + 5 E bytes at the copy bandwidth (bytes read +
    written per second), SQNR off."""
    traffic = 2 * master_bytes + 5 * engine_bytes
    floor_s = traffic / (copy_gbps * 1e9)
    return {"floor_bytes": traffic, "floor_s": floor_s, "floor_gbps": engine_bytes / floor_s / 1e9}


def print_row(r: dict) -> None:
    s = r["share"]
    peak = r["peak_extra_bytes"]
    print(
        f"  {r['preset']:>18}: {r['sync_s']:.3f} s/sync ({r['sync_with_sqnr_s']:.3f} s with "
        f"SQNR, {r.get('sync_with_sampled_sqnr_s', math.nan):.3f} s sampled as the loop does), "
        f"{r['gbps']:.1f} GB/s = {r['ratio_to_baseline']:.2f} x baseline; quantize "
        f"{s['quantize']:.0%} checksum {s['checksum']:.0%} transfer {s['transfer']:.0%} load "
        f"{s['load']:.0%}; peak extra {'-' if peak is None else f'{peak / 2**20:.0f} MiB'}; "
        f"48 layers {r['sync_s_48_layers']:.2f} s"
        + (
            f"; byte floor {r['floor_s'] * 1e3:.1f} ms ({r['floor_gbps']:.0f} GB/s)"
            if "floor_s" in r
            else ""
        )
    )


def copy_gbps(device: torch.device, nbytes: int) -> dict:
    if device.type == "cuda":
        return copy_bandwidth(torch.empty(nbytes // 4, device=device))
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device, 3)
    return {"bytes": 2 * nbytes, "ms": t * 1e3, "gbps": 2 * nbytes / t / 1e9}


# --- in-process -----------------------------------------------------------------------------
def in_process(args, device: torch.device) -> dict:
    config = config_of(args.layers, args.vocab, args.tiny)
    model = build_model(config, seed=0).to(device)
    bandwidth = copy_gbps(device, args.copy_bytes)
    print(f"copy bandwidth on {device}: {bandwidth['gbps']:.0f} GB/s")
    rows = []
    for preset in args.presets:
        engine = Engine(model, preset, device=device, compute_dtype=torch.bfloat16)
        sync = InProcessTransport(engine)
        step = iter(range(1, 10**6))

        def once(sqnr=False, sync=sync, engine=engine, step=step):
            exp = export(
                model, engine.plan, step=next(step), sqnr=sqnr, bucket_bytes=args.bucket_bytes
            )
            sync.send(exp)

        seconds = timed(once, device, args.repeats)
        seconds_sqnr = timed(lambda once=once: once(True), device, args.repeats, warmup=False)
        # as the GRPO loop measures it: each expert stack's every 16th expert (rl.md)
        sample = SqnrSample(LOOP_SQNR_STRIDE, 1)
        seconds_sampled = timed(lambda o=once, s=sample: o(s), device, args.repeats, warmup=False)
        peak = peak_extra(once, device)
        stages = breakdown(model, engine, device, args.repeats)
        row = row_common(
            preset, engine, seconds, seconds_sqnr, stages, 0.0, peak, bandwidth["gbps"], args
        )
        if args.profile and device.type == "cuda":
            profile_call(lambda o=once, s=sample: o(s), device, f"sync {preset}")
        row["sync_with_sampled_sqnr_s"] = seconds_sampled
        row["sampled_sqnr_share"] = 1.0 - seconds / seconds_sampled
        masters = sum(p.numel() * p.element_size() for p in model.parameters())
        row.update(byte_floor(masters, row["engine_bytes"], bandwidth["gbps"]))
        row["x_floor"] = seconds / row["floor_s"]
        rows.append(row)
        print_row(row)
        del engine, sync
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "mode": "in_process",
        "model": {"layers": args.layers, "vocab": args.vocab, "tiny": args.tiny},
        "bucket_bytes": args.bucket_bytes,
        "repeats": args.repeats,
        "baseline": "device-to-device copy_ (bytes read + written)",
        "copy_bandwidth": bandwidth,
        "rows": rows,
    }


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The options this script and sync_nccl.py share: the model, the timing, the output."""
    ap.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-bytes", type=int, default=512 * 2**20)
    ap.add_argument("--copy-bytes", type=int, default=1 << 30)
    ap.add_argument("--tiny", action="store_true", help="tiny layer shapes (the logic on a CPU)")
    ap.add_argument("--out", help="results JSON (default on CUDA: benchmarks/results/h200.json)")


def shrink_tiny(args: argparse.Namespace) -> argparse.Namespace:
    if args.tiny:
        args.vocab = min(args.vocab, 256)
        args.copy_bytes = min(args.copy_bytes, 1 << 22)
        args.bucket_bytes = min(args.bucket_bytes, 1 << 16)
    return args


def write_section(out: str | None, key: str, section: dict, device: torch.device) -> None:
    """The section with this run's environment into `out` (default on CUDA: h200.json)."""
    env = environment() if device.type == "cuda" else cpu_environment()
    if device.type == "cuda":
        env["num_gpus"] = torch.cuda.device_count()
    out = out or (
        str(REPO_ROOT / "benchmarks/results/h200.json") if device.type == "cuda" else None
    )
    if out:
        update_results(Path(out), key, {**section, "environment": env}, {})
        print(f"wrote the {key} section of {out}")


NCCL_MOVED = (
    "sync.py --nccl has moved: run torchrun --nproc-per-node 2 benchmarks/sync_nccl.py "
    "(same options, without --nccl)"
)


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Two GPUs over NCCL: torchrun --nproc-per-node 2 benchmarks/sync_nccl.py",
    )
    add_model_arguments(ap)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="a profiled sync per preset")
    ap.add_argument("--nccl", action="store_true", help=argparse.SUPPRESS)  # moved: NCCL_MOVED
    return shrink_tiny(ap.parse_args(argv))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.nccl:
        print(NCCL_MOVED, file=sys.stderr)
        return 2
    check_presets(args.presets)
    device = check_device(args.device)
    write_section(args.out, "sync", in_process(args, device), device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
