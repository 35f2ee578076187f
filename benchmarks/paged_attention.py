"""The engine's paged attention at long contexts against its K/V byte floor, and what a split
of the keys would buy (docs/benchmarks.md, "Decode at 4k contexts").

One decode token per request, B requests of `--context` keys each (Qwen3-30B-A3B's attention:
32 query / 4 KV heads of 128, bf16, 16-token cache blocks scattered over the cache as a live
one is), one layer:
- the engine's kernel (`mxrl.kernels.triton_attention`: one program per query tile and KV head,
  walking the request's blocks in order), at its launch and with other warps and pipeline
  stages, which keep its bytes (each row says so);
- the engine's `attention_split` (mxrl/kernels/triton_attention_split.py: the keys cut at
  fixed positions, one program per split walking one block at a time, merged in order);
- a split-KV prototype: the keys cut at fixed positions (`--split` keys), one program per
  (tile, KV head, split) walking STEP cache blocks at a time, the partial softmaxes combined in
  split order by a second kernel. Batch-invariant (a row's splits depend on its own position
  only) but not the engine's bytes: a fast path of this kind would be an engine option.
Floor: the K/V bytes over the copy bandwidth of the same run. Median of 20 timed calls.

    python benchmarks/paged_attention.py [--context 4096] [--batch 16 64 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl
from common import ensure_repo_on_path

ensure_repo_on_path()

from mxrl.kernels.attention import attention_tiles, block_m  # noqa: E402
from mxrl.kernels.triton_attention import paged_attention_kernel  # noqa: E402

N, K, D, BS = 32, 4, 128, 16
G = N // K


@triton.jit
def split_kernel(  # one split of one tile's keys: its partial max, sum and weighted values

    q_ptr, k_cache_ptr, v_cache_ptr, m_ptr, l_ptr, acc_ptr, block_tables_ptr,
    tile_token_ptr, tile_rows_ptr, tile_pos_ptr, tile_req_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, scale, NSPLIT, SPLIT_BLOCKS,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEADS_KV: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    head_kv = tl.program_id(1)
    split = tl.program_id(2)
    t0 = tl.load(tile_token_ptr + tile)
    rows = tl.load(tile_rows_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)
    req = tl.load(tile_req_ptr + tile)
    m_idx = tl.arange(0, BLOCK_M)
    qi = m_idx // G
    head = head_kv * G + m_idx % G
    valid = qi < rows
    dk = tl.arange(0, D)
    q_off = (t0 + qi)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + dk[None, :]
    q = tl.load(q_ptr + q_off, mask=valid[:, None], other=0.0)
    q_pos = pos0 + qi
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    num_blocks = (pos0 + rows - 1) // BLOCK_N + 1
    lo = split * SPLIT_BLOCKS
    hi = tl.minimum(lo + SPLIT_BLOCKS, num_blocks)
    for b in range(lo, hi, STEP):
        # STEP cache blocks at once: one [STEP*BLOCK_N, D] key tile
        kn = tl.arange(0, STEP * BLOCK_N)
        blk = b + kn // BLOCK_N
        inb = blk < hi
        block = tl.load(block_tables_ptr + req * stride_bt + blk, mask=inb, other=0).to(tl.int64)
        slot = kn % BLOCK_N
        k = tl.load(
            k_cache_ptr
            + block[:, None] * stride_kb
            + slot[:, None] * stride_ks
            + head_kv * stride_kh
            + dk[None, :],
            mask=inb[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vb
            + slot[:, None] * stride_vs
            + head_kv * stride_vh
            + dk[None, :],
            mask=inb[:, None],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k)) * scale
        k_pos = b * BLOCK_N + kn
        s = tl.where((k_pos[None, :] <= q_pos[:, None]) & inb[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    base = (tile * HEADS_KV + head_kv) * NSPLIT + split
    tl.store(m_ptr + base * BLOCK_M + m_idx, m_i)
    tl.store(l_ptr + base * BLOCK_M + m_idx, l_i)
    tl.store(acc_ptr + (base * BLOCK_M + m_idx)[:, None] * D + dk[None, :], acc)


@triton.jit
def combine_kernel(  # a tile's partials, combined in split order, normalised and stored

    m_ptr, l_ptr, acc_ptr, o_ptr, tile_token_ptr, tile_rows_ptr, tile_pos_ptr,
    stride_ot, stride_oh, NSPLIT, SPLIT_BLOCKS,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEADS_KV: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    head_kv = tl.program_id(1)
    t0 = tl.load(tile_token_ptr + tile)
    rows = tl.load(tile_rows_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)
    num_blocks = (pos0 + rows - 1) // BLOCK_N + 1
    used = (num_blocks + SPLIT_BLOCKS - 1) // SPLIT_BLOCKS
    m_idx = tl.arange(0, BLOCK_M)
    dk = tl.arange(0, D)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for s in range(0, used):
        base = ((tile * HEADS_KV + head_kv) * NSPLIT + s) * BLOCK_M + m_idx
        ms = tl.load(m_ptr + base)
        ls = tl.load(l_ptr + base)
        accs = tl.load(acc_ptr + base[:, None] * D + dk[None, :])
        m_new = tl.maximum(m, ms)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - m_safe)
        bb = tl.exp(ms - m_safe)
        l_sum = l_sum * a + ls * bb
        acc = acc * a[:, None] + accs * bb[:, None]
        m = m_new
    qi = m_idx // G
    head = head_kv * G + m_idx % G
    valid = qi < rows
    out = acc / l_sum[:, None]
    o_off = (t0 + qi)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + dk[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=valid[:, None])


def split_attention(q, kc, vc, bt, tiles, scale, split_keys, step, warps=4):
    """The split-KV prototype: partials per (tile, KV head, split), then their combination."""
    bm = block_m(G)
    split_blocks = split_keys // BS
    nsplit = triton.cdiv(int(bt.shape[1]), split_blocks)
    nt = tiles.num_tiles
    m = torch.empty((nt, K, nsplit, bm), device=q.device, dtype=torch.float32)
    lsum = torch.empty_like(m)
    acc = torch.empty((nt, K, nsplit, bm, D), device=q.device, dtype=torch.float32)
    out = q.new_empty(q.shape)
    split_kernel[(nt, K, nsplit)](
        q, kc, vc, m, lsum, acc, bt, tiles.token, tiles.rows, tiles.pos, tiles.req,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), bt.stride(0), scale, nsplit, split_blocks,
        G=G, D=D, BLOCK_M=bm, BLOCK_N=BS, HEADS_KV=K, STEP=step, num_warps=warps,
    )  # fmt: skip
    combine_kernel[(nt, K)](
        m, lsum, acc, out, tiles.token, tiles.rows, tiles.pos, out.stride(0), out.stride(1),
        nsplit, split_blocks, G=G, D=D, BLOCK_M=bm, BLOCK_N=BS, HEADS_KV=K, num_warps=4,
    )  # fmt: skip
    return out


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
    """(name, settings): the engine's kernel first, then its launch variants, then splits."""
    if device.type != "cuda":  # the interpreter: the logic only
        return [("engine", {}), ("split 32 step 2", dict(split=32, step=2)),
                ("engine attention_split 32", dict(engine_split=32))]  # fmt: skip
    rows = [("engine (4 warps)", {})]
    rows += [(f"engine {w} warps {s} stages", dict(warps=w, stages=s))
             for w, s in ((4, 1), (4, 2), (4, 4), (8, 3), (2, 3))]  # fmt: skip
    rows += [(f"split {sk} step {st} {w} warps", dict(split=sk, step=st, warps=w))
             for sk, st, w in ((512, 1, 4), (512, 4, 4), (1024, 4, 4), (256, 4, 4), (512, 8, 4),
                               (512, 4, 8), (1024, 8, 8))]  # fmt: skip
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
            elif "split" in cfg:
                fn = lambda cfg=cfg, ops=ops: split_attention(  # noqa: E731
                    *ops, cfg["split"], cfg["step"], cfg.get("warps", 4)
                )
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
