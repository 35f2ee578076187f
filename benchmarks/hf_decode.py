"""HF transformers' greedy `generate` on the same weights as the engine, timed the way
benchmarks/engine_decode.py times the engine: the HF column of its decode rows.

The checkpoint is the master weights through `mxrl.models.save_pretrained` (bf16), loaded by
`AutoModelForCausalLM.from_pretrained` in bf16 with `experts_implementation="grouped_mm"`
(transformers' fused MoE path); where transformers refuses that option at load, the eager
experts loop, and the row says which ran (`experts_implementation`). Every request generates
exactly N tokens (min_new_tokens = N), so the step count is the engine's.

What HF's cache holds differs from the engine's for MLA: transformers 5.24's
`DeepseekV3Attention` caches the latent (kv_lora_rank + the RoPE key per token and layer) and
expands the whole context through `kv_b_proj` at every step; the engine caches the expanded
per-head K/V. Each row records the transformers version it ran (the device's may differ).
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

import torch
from common import decode_timing, ensure_repo_on_path, load_hf

ensure_repo_on_path()

from mxrl.models import save_pretrained  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _version() -> str:
    import transformers

    return transformers.__version__


def _generate_s(model, ids: torch.Tensor, new_tokens: int) -> float:
    _sync(ids.device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    _sync(ids.device)
    return time.perf_counter() - start


def hf_batch_row(model, ids: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    """One warm-up of each call, then medians over `repeats` of t_N and t_1, as the engine's."""
    n = new_tokens
    _generate_s(model, ids, n)
    _generate_s(model, ids, 1)
    t_n, t_1 = [], []
    for _ in range(repeats):
        t_n.append(_generate_s(model, ids, n))
        t_1.append(_generate_s(model, ids, 1))
    return {**decode_timing(t_n, t_1, ids.shape[0], n), "repeats": repeats}


def hf_decode_rows(master, prompts: list[list[int]], device: torch.device, args) -> list[dict]:
    """Rows of preset "hf" per batch size in `args.batch` (the engine rows' keys they share), on
    the `master` model's weights written once as a bf16 checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(master, tmp, dtype=torch.bfloat16, progress=False)
        model, impl = load_hf(Path(tmp))
        model = model.to(device).eval()
    rows = []
    for b in args.batch:
        ids = torch.tensor(prompts[:b], device=device)
        row = hf_batch_row(model, ids, args.new_tokens, args.repeats)
        rows.append({"preset": "hf", "backend": "transformers", **row,
                     "experts_implementation": impl, "transformers": _version()})  # fmt: skip
        print(f"  hf ({impl}) B={b}: {row['tokens_per_s']:.1f} tok/s ({row['total_s']:.2f} s)")
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def add_hf_ratios(rows: list[dict]) -> None:
    """Each engine row's step time against HF's at its batch size (> 1: the engine is faster)."""
    hf = {r["batch"]: r for r in rows if r["preset"] == "hf"}
    for r in rows:
        h = hf.get(r["batch"])
        ok = r["preset"] != "hf" and h is not None and h["ms_per_step"] and r["ms_per_step"]
        r["speedup_vs_hf"] = h["ms_per_step"] / r["ms_per_step"] if ok else None
