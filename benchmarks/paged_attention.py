"""The engine's paged attention at long contexts against its K/V byte floor, and what a split
of the keys would buy (docs/benchmarks.md, "Decode at 4k contexts").

One decode token per request, B requests of `--context` keys each (Qwen3-30B-A3B's attention:
32 query / 4 KV heads of 128, bf16, 16-token cache blocks scattered over the cache as a live
one is), one layer:
- the engine's kernel (`mxrl.kernels.triton_attention`: one program per query tile and KV head,
  walking the request's blocks in order), at its launch and with other warps and pipeline
  stages, which keep its bytes (each row says so);
- the engine's `attention_split` (mxrl/kernels/triton_attention_split.py: the keys cut at
  fixed positions, one program per (tile, KV head, split) walking up to 4 cache blocks a step,
  the splits merged in order by a second kernel; batch-invariant, not the one-pass bytes).
  (The split-KV prototype this kernel was built from, with its STEP and warps variants, ran
  here until commit d8fb0bc; its rows are in docs/benchmarks.md.)
Floor: the K/V bytes over the copy bandwidth of the same run. Median of 20 timed calls.

    python benchmarks/paged_attention.py [--context 4096] [--batch 16 64 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import ensure_repo_on_path

ensure_repo_on_path()

from mxrl.kernels.attention import attention_tiles, block_m  # noqa: E402
from mxrl.kernels.triton_attention import paged_attention_kernel  # noqa: E402

N, K, D, BS = 32, 4, 128, 16
G = N // K


def engine_kernel(q, kc, vc, bt, tiles, scale, warps=4, stages=None):
    """The engine's launch (`mxrl.kernels.attention.paged_attention`), warps and stages aside."""
    out = q.new_empty(q.shape)
    kw = {} if stages is None else {"num_stages": stages}
    paged_attention_kernel[(tiles.num_tiles, K)](
        q, kc, vc, kc, kc, out, bt, tiles.token, tiles.rows, tiles.pos, tiles.req,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        bt.stride(0), scale, G=G, DK=D, DV=D, BLOCK_DK=D, BLOCK_DV=D, BLOCK_M=block_m(G),
        BLOCK_N=BS, IEEE=q.dtype == torch.float32, FP8=False, HEADS_KV=K, HW=q.is_cuda,
        num_warps=warps, **kw,
    )  # fmt: skip
    return out


def engine_split(q, kc, vc, bt, tiles, scale, split_keys):
    """The engine's `attention_split` (mxrl/kernels/triton_attention_split.py)."""
    from mxrl.kernels.attention import paged_attention

    return paged_attention(q, kc, vc, bt, tiles, scale, split_keys=split_keys,
                           max_keys=bt.shape[1] * BS)  # fmt: skip


def timed_s(fn, device: torch.device, reps: int = 20) -> float:
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def copy_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / timed_s(lambda: y.copy_(x), device) / 1e9


def variants(device: torch.device) -> list[tuple[str, dict]]:
    """(name, settings): the engine's kernel first, then its launch variants, then its splits."""
    if device.type != "cuda":  # the interpreter: the logic only
        return [("engine", {}), ("engine attention_split 32", dict(engine_split=32))]
    rows = [("engine (4 warps)", {})]
    rows += [(f"engine {w} warps {s} stages", dict(warps=w, stages=s))
             for w, s in ((4, 1), (4, 2), (4, 4), (8, 3), (2, 3))]  # fmt: skip
    rows += [(f"engine attention_split {sk}", dict(engine_split=sk)) for sk in (256, 512, 1024)]
    return rows


def run(context: int, batches: list[int], device: torch.device) -> list[dict]:
    bw = copy_gbps(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}: copy {bw or float('nan'):.0f} GB/s, context {context}")
    g = torch.Generator(device=device).manual_seed(0)
    g_cpu = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        per = -(-context // BS)
        blocks = b * per + 1
        kc = torch.randn((blocks, BS, K, D), generator=g, device=device).to(torch.bfloat16)
        vc = torch.randn((blocks, BS, K, D), generator=g, device=device).to(torch.bfloat16)
        perm = torch.randperm(blocks - 1, generator=g_cpu) + 1  # scattered, as a live cache
        bt = perm.view(b, per).to(device, torch.int32).contiguous()
        q = torch.randn((b, N, D), generator=g, device=device).to(torch.bfloat16)
        tiles = attention_tiles([(r, 1, context) for r in range(b)], G, device)
        kv_bytes = 2 * b * context * K * D * 2
        floor_s = kv_bytes / (bw * 1e9) if bw else None
        scale = D**-0.5
        ref = engine_kernel(q, kc, vc, bt, tiles, scale)
        for label, cfg in variants(device):
            ops = (q, kc, vc, bt, tiles, scale)
            if "engine_split" in cfg:
                fn = lambda cfg=cfg, ops=ops: engine_split(*ops, cfg["engine_split"])  # noqa: E731
            else:
                fn = lambda cfg=cfg, ops=ops: engine_kernel(*ops, **cfg)  # noqa: E731
            out = fn()
            row = {
                "batch": b, "context": context, "variant": label,
                "ms": timed_s(fn, device) * 1e3, "kv_bytes": kv_bytes,
                "floor_ms": None if floor_s is None else floor_s * 1e3,
                "same_bytes": torch.equal(out.view(torch.int16), ref.view(torch.int16)),
                "max_abs_diff": (out.float() - ref.float()).abs().max().item(),
            }  # fmt: skip
            row["x_floor"] = None if floor_s is None else row["ms"] / row["floor_ms"]
            rows.append(row)
            x = "" if row["x_floor"] is None else f"  x floor {row['x_floor']:5.2f}"
            print(f"B={b:4d} {label:28s} {row['ms']:8.3f} ms{x}  engine's bytes "
                  f"{row['same_bytes']}  max|d| {row['max_abs_diff']:.1e}", flush=True)  # fmt: skip
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    run(args.context, args.batch, torch.device(args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
