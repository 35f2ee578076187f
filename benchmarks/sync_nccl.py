"""Weight sync trainer -> engine across two GPUs over NCCL: seconds and GB/s per sync, per preset.

Seconds per sync and GB/s of engine bytes per preset, against a peer copy cuda:0 -> cuda:1 and a
raw NCCL broadcast and send/recv of the same size, measured in the same run (issue 13). The
in-process sync is benchmarks/sync.py, whose model, timing, stage breakdown and rows this script
imports.

    torchrun --nproc-per-node 2 benchmarks/sync_nccl.py         # 2 GPUs: cuda:0 -> cuda:1

Model: as in benchmarks/sync.py (Qwen3-30B-A3B's layer shapes, `--layers` layers (4), vocab
151936, seeded fp32 master weights), built on each rank's GPU. A sync is
`BroadcastSender.send(export(model, plan, step=s))` on rank 0 (cuda:0) and
`BroadcastReceiver.receive` on rank 1 (cuda:1), the engine computing in bf16.
Timed with the device synchronized before and after, the median of `--repeats` after a warm-up.
The warm-up teaches both ends the update's layout, so the timed syncs run scheduled
(`mxrl.sync.broadcast`); the same syncs from a fresh sender, which goes bucket by bucket, are
timed too (`sync_s_per_bucket`), in the same run.

Per preset: seconds per sync (with the per-layer SQNR off, and on), GB/s of engine bytes, the
ratio to the peer copy, to the raw NCCL broadcast and to send/recv, the peak memory the sync
allocates beyond what trainer and engine hold, and the share of each stage, each timed alone and
synchronized on each rank (`sync.breakdown`): quantize, checksum (twice: once on send, once on
receive), transfer (a raw broadcast of the payload bytes) and load (`load_weights` of records
verified already). The shares are of the stages' work, not of the sync's wall time where stages
overlap: the receiver checksums bucket k while bucket k+1 is on the wire, so the row also gives
what of its checksum the transfer did not hide, from `BroadcastReceiver.timings` (the last
payload's arrival to the last checksum compared): `receiver_checksum_tail_s` and its share of
the sync. The 48-layer row scales the sync time as benchmarks/sync.py does.
Rank 0 writes the `sync_nccl` section of the results JSON.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics

import torch
import torch.distributed as dist
from common import ensure_repo_on_path
from engine_decode import check_presets
from sync import (
    add_model_arguments,
    breakdown,
    config_of,
    peak_extra,
    print_row,
    row_common,
    shrink_tiny,
    timed,
    write_section,
)

ensure_repo_on_path()

from mxrl.engine import Engine  # noqa: E402
from mxrl.models import build_model  # noqa: E402
from mxrl.sync import BroadcastReceiver, BroadcastSender  # noqa: E402
from mxrl.weights import export  # noqa: E402


def nccl(args) -> dict | None:
    """Rank 0 broadcasts each preset's syncs to rank 1; rank 0 returns the section, rank 1 None."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 2:
        raise SystemExit(
            "sync_nccl.py runs on two ranks: torchrun --nproc-per-node 2 benchmarks/sync_nccl.py"
        )
    rank = int(os.environ["RANK"])
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
    add_model_arguments(ap)
    return shrink_tiny(ap.parse_args(argv))


def main(argv=None) -> int:
    args = parse_args(argv)
    check_presets(args.presets)
    section = nccl(args)
    if section is not None:  # rank 0
        write_section(args.out, "sync_nccl", section, torch.device("cuda", 0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
