"""Weight sync trainer -> engine: seconds per sync and GB/s of engine bytes per preset, against the
device's copy bandwidth measured in the same run (issue 13).

    python benchmarks/sync.py                                   # H200: in-process, one GPU
    torchrun --nproc-per-node 2 benchmarks/sync.py --nccl       # 2 GPUs: cuda:0 -> cuda:1
    python benchmarks/sync.py --tiny --device cpu               # the script's logic, in seconds

Model: Qwen3-30B-A3B's layer shapes (benchmarks/families.py), `--layers` layers (4), vocab
151936, seeded fp32 master weights on the device. A sync is what the GRPO loop runs after each
optimizer step: `InProcessTransport(engine).send(export(model, plan, step=s))`, trainer and
engine on the same GPU (the engine computing in bf16, its default backend); in --nccl mode
`BroadcastSender.send` on rank 0 (cuda:0) and `BroadcastReceiver.receive` on rank 1 (cuda:1).
Timed with the device synchronized before and after, the median of `--repeats` after a warm-up.
In --nccl mode the warm-up teaches both ends the update's layout, so the timed syncs run
scheduled (`mxrl.sync.broadcast`); the same syncs from a fresh sender, which goes bucket by
bucket, are timed too (`sync_s_per_bucket`), in the same run.

Per preset: seconds per sync (with the per-layer SQNR off, and on as the loop runs it), GB/s of
engine bytes (every record's data, scales and global scales), in-process the byte floor (the
masters read twice, the engine bytes written, checksummed twice and copied in: `byte_floor`,
2 M + 5 E bytes at the copy bandwidth) and the sync's time over it, the ratio to the copy bandwidth
(in-process: a device-to-device `copy_` counting bytes read + written; --nccl: a peer copy
cuda:0 -> cuda:1, and a raw NCCL broadcast and send/recv of the same size), the peak memory the
sync allocates beyond what trainer and engine hold, and the share of each stage, each timed
alone and synchronized: quantize (`quantized_values`), checksum (twice: once on send, once on
receive), transfer (--nccl: a raw broadcast of the payload bytes; in-process: none, records are
handed over by reference) and load (`load_weights` of records verified already, as the distributed receiver
hands them: the copy into the engine's buffers and the GEMM operands derived from them). The
shares are of the stages' work, not of the sync's wall time where stages overlap: in --nccl mode
the receiver checksums bucket k while bucket k+1 is on the wire, so the row also gives what of
its checksum the transfer did not hide, from `BroadcastReceiver.timings` (the last payload's
arrival to the last checksum compared): `receiver_checksum_tail_s` and its share of the sync.
The 48-layer row scales the sync time by the engine bytes of a 48-layer plan (resolved on the
full model's shapes, bytes per format by formula).
Writes the `sync` (in-process) or `sync_nccl` section of the results JSON.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
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


# --- two GPUs over NCCL -------------------------------------------------------------------------
def nccl(args) -> dict | None:
    import torch.distributed as dist

    from mxrl.sync import BroadcastReceiver, BroadcastSender

    rank = int(os.environ["RANK"])
    if int(os.environ.get("WORLD_SIZE", "1")) != 2:
        raise SystemExit(
            "--nccl runs on two ranks: torchrun --nproc-per-node 2 benchmarks/sync.py --nccl"
        )
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    config = config_of(args.layers, args.vocab, args.tiny)
    bandwidth = {"p2p_copy": None, "nccl_broadcast": None, "nccl_send_recv": None}
    buf = torch.empty(args.copy_bytes, dtype=torch.uint8, device=device)

    def rate(fn, on: torch.device) -> dict:  # args.copy_bytes moved once per call of fn
        t = timed(fn, on, args.repeats)
        return {"bytes": args.copy_bytes, "s": t, "gbps": args.copy_bytes / t / 1e9}

    if rank == 0:  # a peer copy cuda:0 -> cuda:1, the bytes moved once
        dst = torch.empty(args.copy_bytes, dtype=torch.uint8, device="cuda:1")
        bandwidth["p2p_copy"] = rate(lambda: dst.copy_(buf), torch.device("cuda:1"))
        del dst

    def broadcast(nbytes=args.copy_bytes):
        dist.broadcast(buf[:nbytes], src=0)

    bandwidth["nccl_broadcast"] = rate(broadcast, device)

    def send_recv(nbytes=args.copy_bytes):  # the point-to-point alternative, for comparison
        if rank == 0:
            dist.send(buf[:nbytes], dst=1)
        else:
            dist.recv(buf[:nbytes], src=0)

    bandwidth["nccl_send_recv"] = rate(send_recv, device)
    rows = []
    model = build_model(config, seed=0).to(device)
    for preset in args.presets:
        engine = Engine(model, preset, device=device, compute_dtype=torch.bfloat16)
        step = iter(range(1, 10**6))
        if rank == 0:
            end = BroadcastSender(src=0)

            def once(sqnr=False, fresh=False, end=end, engine=engine, step=step):
                dist.barrier()
                exp = export(
                    model, engine.plan, step=next(step), sqnr=sqnr, bucket_bytes=args.bucket_bytes
                )
                # fresh: a sender that has not learnt the layout, so the update goes per bucket
                (BroadcastSender(src=0) if fresh else end).send(exp)
        else:
            end = BroadcastReceiver(engine, src=0)
            tails: list[float] = []

            def once(sqnr=False, fresh=False, end=end, tails=tails):
                dist.barrier()
                end.receive()
                tails.append(end.timings["verified"] - end.timings["arrived"])

        seconds = timed(once, device, args.repeats)  # the warm-up teaches both ends the layout
        mode = end.last_mode
        tail = statistics.median(tails[1:]) if rank == 1 else None  # the timed runs
        per_bucket = timed(lambda once=once: once(fresh=True), device, args.repeats, warmup=False)
        seconds_sqnr = timed(lambda once=once: once(True), device, args.repeats, warmup=False)
        peak = peak_extra(once, device)
        engine_bytes = sum(r.nbytes for r in engine.records())
        transfer = timed(
            lambda n=engine_bytes: broadcast(min(n, args.copy_bytes)), device, args.repeats
        )
        transfer *= engine_bytes / min(engine_bytes, args.copy_bytes)
        stages = breakdown(model, engine, device, args.repeats)  # this rank's own stages
        base = bandwidth["p2p_copy"]["gbps"] if rank == 0 else bandwidth["nccl_broadcast"]["gbps"]
        row = row_common(preset, engine, seconds, seconds_sqnr, stages, transfer, peak, base, args)
        row.update(rank=rank, mode=mode, sync_s_per_bucket=per_bucket)
        row["gbps_per_bucket"] = engine_bytes / per_bucket / 1e9
        if tail is not None:
            row["receiver_checksum_tail_s"] = tail
            row["receiver_checksum_tail_share"] = tail / seconds
        gathered = [None, None]
        dist.all_gather_object(gathered, {"row": row, "bandwidth": bandwidth})
        if rank == 0:
            sender, receiver = gathered[0]["row"], gathered[1]["row"]
            p2p = bandwidth["p2p_copy"]["gbps"]
            rows.append(
                {
                    "preset": preset,
                    "engine_bytes": engine_bytes,
                    "sync_s": sender["sync_s"],
                    "sync_with_sqnr_s": sender["sync_with_sqnr_s"],
                    "gbps": sender["gbps"],
                    "ratio_to_p2p_copy": sender["gbps"] / p2p,
                    "ratio_to_nccl_broadcast": sender["gbps"] / bandwidth["nccl_broadcast"]["gbps"],
                    "ratio_to_nccl_send_recv": sender["gbps"] / bandwidth["nccl_send_recv"]["gbps"],
                    "mode": sender["mode"],
                    "sync_s_per_bucket": sender["sync_s_per_bucket"],
                    "ratio_to_p2p_copy_per_bucket": sender["gbps_per_bucket"] / p2p,
                    "sync_s_48_layers": sender["sync_s_48_layers"],
                    "receiver_checksum_tail_share": receiver["receiver_checksum_tail_share"],
                    "sender": sender,
                    "receiver": receiver,
                }
            )
            print_row(sender)
            raw = {k: bandwidth[k]["gbps"] for k in ("nccl_broadcast", "nccl_send_recv")}
            print(f"    raw NCCL 1 GiB: broadcast {raw['nccl_broadcast']:.0f} GB/s, "
                  f"send/recv {raw['nccl_send_recv']:.0f} GB/s")  # fmt: skip
            print(
                f"    = {rows[-1]['ratio_to_p2p_copy']:.2f} x the peer copy ({p2p:.0f} GB/s) "
                f"{sender['mode']}; per bucket {sender['sync_s_per_bucket']:.4f} s = "
                f"{rows[-1]['ratio_to_p2p_copy_per_bucket']:.2f} x; "
                "receiver checksum after the last payload "
                f"{receiver['receiver_checksum_tail_s'] * 1e3:.2f} ms "
                f"({receiver['receiver_checksum_tail_share']:.0%} of its sync)"
            )
        del engine, end
        gc.collect()
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {
        "mode": "nccl",
        "model": {"layers": args.layers, "vocab": args.vocab, "tiny": args.tiny},
        "bucket_bytes": args.bucket_bytes,
        "repeats": args.repeats,
        "baseline": (
            "peer copy cuda:0 -> cuda:1 (bytes moved once); raw NCCL broadcast and send/recv"
        ),
        "bandwidth": bandwidth,
        "rows": rows,
    }


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-bytes", type=int, default=512 * 2**20)
    ap.add_argument("--copy-bytes", type=int, default=1 << 30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--nccl", action="store_true", help="2 GPUs under torchrun --nproc-per-node 2")
    ap.add_argument("--tiny", action="store_true", help="tiny layer shapes (the logic on a CPU)")
    ap.add_argument("--profile", action="store_true", help="in-process: a profiled sync per preset")
    ap.add_argument("--out", help="results JSON (default on CUDA: benchmarks/results/h200.json)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.vocab = min(args.vocab, 256)
        args.copy_bytes = min(args.copy_bytes, 1 << 22)
        args.bucket_bytes = min(args.bucket_bytes, 1 << 16)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    check_presets(args.presets)
    if args.nccl:
        section, key, device = nccl(args), "sync_nccl", torch.device("cuda", 0)
        if section is None:
            return 0
    else:
        device = check_device(args.device)
        section, key = in_process(args, device), "sync"
    env = environment() if device.type == "cuda" else cpu_environment()
    if device.type == "cuda":
        env["num_gpus"] = torch.cuda.device_count()
    out = args.out or (
        str(REPO_ROOT / "benchmarks/results/h200.json") if device.type == "cuda" else None
    )
    if out:
        update_results(Path(out), key, {**section, "environment": env}, {})
        print(f"wrote the {key} section of {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
