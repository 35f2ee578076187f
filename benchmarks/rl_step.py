"""The GRPO step as the article reports it: rollout, training and weight-sync seconds per preset
against bf16, every preset on the same model, prompts and response lengths, in one run.

    python benchmarks/rl_step.py                      # H200: Qwen3-30B-A3B layers, 64 x 8
    python benchmarks/rl_step.py --tiny --device cpu  # the script's logic, in seconds

Model: Qwen3-30B-A3B's layer shapes (benchmarks/families.py), `--layers` layers, vocab
32000, seeded random weights, the same master for every preset. A step is `GRPOTrainer.
train_step` as `mxrl train` runs it: rollout of `--prompts` x `--samples` sequences (GRPO groups
sharing their prompt's KV blocks, temperature 1) on the engine, rewards, the training pass in
micro-batches of at most `--micro-batch-tokens` padded tokens (the policy's logprobs at the
rollout's tokens come from the training forward itself: one update per batch, so there is no
separate old-logprob pass; `logprob s` is therefore part of `train s`), the optimizer step, and
the verified weight sync as the loop runs it (per-layer SQNR on, `verify_every` steps deep).

Response lengths: random weights rarely emit a stop token, so each request's length is drawn
once from a seeded spread (exponential with mean `--new-tokens`/3, between 16 and
`--new-tokens`: most short, a tail at the limit, as real rollouts) and given to the engine as its
`max_new_tokens`; every preset generates exactly the same number of tokens. Step 1 is a warm-up
(allocator, autotuning, CUDA-graph capture); the rows are the median of steps 2..1+`--steps`.
`--kv-fp8 [PRESET ...]` adds those presets (none named: every one) once more with `kv_cache: fp8`.
Writes the `rl_step` section after each preset, so the rows measured survive a later failure.
Each row's `sync_phases` holds, per timed step, the sync in phases (export, engine update,
digest; seconds, each phase ending when the device is done), the Python garbage collector's
pauses inside it, and the CUDA caching allocator's device allocations, frees and retries (the
suspects for a loop's sync slower than `benchmarks/sync.py`'s); `gc_step_s` the collector's
pauses in each whole timed step. `--profile-sync` runs one more step after the timed ones and
profiles its engine update in place (torch.profiler and cProfile; the export's quantization runs
inside it), then one more sync after the steps, for the difference between the two.
The steps run with the heap frozen, as `GRPOTrainer.run` runs them (`mxrl.rl.metrics.
frozen_heap`: every object alive once the trainer is built out of the collector's walks);
`--no-gc-freeze` runs them without, for the collector's share of the step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import (
    REPO_ROOT,
    allocator_counts,
    copy_bandwidth,
    ensure_repo_on_path,
    environment,
    format_table,
    profile_call,
    profile_once,
    update_results,
)
from engine_decode import check_device, check_presets, cpu_environment, model_config
from rollout_floor import rollout_parts, step_floor_bytes

ensure_repo_on_path()

from mxrl.engine import SamplingParams  # noqa: E402
from mxrl.models import build_model, from_pretrained, save_pretrained  # noqa: E402
from mxrl.rl.config import GRPOConfig, TrainConfig  # noqa: E402
from mxrl.rl.memory import device_capacity, estimate_memory  # noqa: E402
from mxrl.rl.metrics import GC_PAUSES, frozen_heap, settle  # noqa: E402
from mxrl.rl.resolve import resolve_train  # noqa: E402
from mxrl.rl.source import PromptBatch  # noqa: E402
from mxrl.rl.trainer import GRPOTrainer  # noqa: E402
from mxrl.runs import RunRecord  # noqa: E402
from mxrl.runs.yamlio import load_yaml  # noqa: E402
from mxrl.weights.event import SqnrSample  # noqa: E402
from mxrl.weights.record import value_nbytes  # noqa: E402

PRESET_DIR = REPO_ROOT / "mxrl" / "recipe" / "presets"

ARTICLE_PRESETS = ("bf16", "mxfp8", "mxfp8-hp", "mxfp8-dequantized", "nvfp4-hp",
                   "nvfp4-dequantized")  # fmt: skip
STAGES = ("rollout_s", "train_s", "sync_s", "step_s")


class RandomPrompts:
    """`--prompts` random prompts of `--prompt` tokens a step (seeded by the step), a reward
    that random weights earn about half the time (parity of the first sampled token) so the
    advantages and gradients are not zero, and no stop token."""

    stop_token_ids: tuple[int, ...] = ()

    def __init__(self, vocab: int, prompt_len: int, seed: int) -> None:
        self.vocab, self.prompt_len, self.seed, self.step = vocab, prompt_len, seed, 0

    def next_batch(self, n: int) -> PromptBatch:
        rng = random.Random(self.seed * 1_000_003 + self.step)
        self.step += 1
        prompts = [[rng.randrange(1, self.vocab) for _ in range(self.prompt_len)] for _ in range(n)]
        return PromptBatch(prompts, [None] * n)

    def reward(self, tokens: list[int], label: object) -> float:
        return float(tokens[0] % 2) if tokens else 0.0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def gc_read() -> tuple[float, int]:
    """The garbage collector's pauses so far: (seconds, collections)."""
    return GC_PAUSES.seconds, GC_PAUSES.collections


def response_lengths(count: int, longest: int, seed: int) -> list[int]:
    """Seeded lengths: exponential with mean longest/3, clamped to [16, longest]."""
    rng = random.Random(seed)
    shortest = min(16, longest)
    return [max(shortest, min(longest, round(rng.expovariate(3 / longest)))) for _ in range(count)]


class FixedLengthTrainer(GRPOTrainer):
    """The trainer with each request's `max_new_tokens` from the seeded table `lengths` (the
    same for every preset); everything else is `mxrl train`'s step."""

    def __init__(self, *args, lengths: list[int], **kwargs) -> None:
        self.lengths = lengths
        super().__init__(*args, **kwargs)
        # each step's sync in phases (export, engine update, digest: seconds, each ended by
        # waiting for the device), the Python GC's pauses inside it, and the caching allocator's
        # device allocations, frees and retries (a cudaMalloc / cudaFree waits for the device)
        self.sync_phases: list[dict[str, float]] = []
        self.profile_at: int | None = None  # --profile-sync: the step whose update is profiled
        GC_PAUSES.install()
        device = self.cfg.device
        export, update, digest = self.actor.export, self.rollout.update, self.rollout.digest
        marks: dict = {}

        def timed_export(*a, **k):
            settle(device)
            marks.update(allocator_counts(device), t=time.perf_counter(), gc=gc_read())
            out = export(*a, **k)
            settle(device)
            marks["export"] = time.perf_counter()
            return out

        def timed_update(*a, **k):
            if self.profile_at == self.step + 1:  # this step's own update (the export's work)
                label = f"the loop's own update, step {self.step + 1}"
                out = profile_once(lambda: update(*a, **k), torch.device(device), label)
            else:
                out = update(*a, **k)
            settle(device)
            marks["update"] = time.perf_counter()
            return out

        def timed_digest(*a, **k):
            out = digest(*a, **k)
            settle(device)
            end, gc_end, after = time.perf_counter(), gc_read(), allocator_counts(device)
            phases = {"export_s": marks["export"] - marks["t"],
                      "update_s": marks["update"] - marks["export"],
                      "digest_s": end - marks["update"], "gc_s": gc_end[0] - marks["gc"][0],
                      "gc_collections": gc_end[1] - marks["gc"][1]}  # fmt: skip
            self.sync_phases.append(phases | {n: after[n] - marks[n] for n in after})
            return out

        self.actor.export, self.rollout.update = timed_export, timed_update
        self.rollout.digest = timed_digest
        generate = self.rollout.generate
        self.last_outs: list = []  # the last rollout's completions (their routing: the floor)

        def kept_generate(*a, **k):
            self.last_outs = generate(*a, **k)
            return self.last_outs

        self.rollout.generate = kept_generate

    def _sampling(self, step: int, index: int) -> SamplingParams:
        params = super()._sampling(step, index)
        return dataclasses.replace(params, max_new_tokens=self.lengths[index])


def recipe_of(preset: str, kv_fp8: bool) -> str | dict:
    """The preset, or (kv_fp8) the preset's recipe with `kv_cache: fp8`, inline."""
    if not kv_fp8:
        return preset
    data = dict(load_yaml(PRESET_DIR / f"{preset}.yaml"))
    return {**data, "name": f"{preset}-kv-fp8", "kv_cache": "fp8"}


def run_preset(path: Path, preset: str, kv_fp8: bool, lengths, device, args, out: Path) -> dict:
    """One preset's steps; its row (median seconds per stage and each timed step's, tokens, peak
    memory)."""
    model = from_pretrained(path, dtype=torch.float32).to(device)
    label = f"{preset}+kv-fp8" if kv_fp8 else preset
    cfg = GRPOConfig(
        recipe=recipe_of(preset, kv_fp8), steps=args.steps + 2, prompts_per_step=args.prompts,
        samples_per_prompt=args.samples, max_new_tokens=args.new_tokens, lr=1e-5, seed=0,
        device=str(device), verify_every=args.verify_every, engine_tile=args.tile,
        max_tokens_per_micro_batch=args.micro_batch_tokens or 0,
        engine_attention_split=args.attention_split, engine_dense_gemm=args.dense_gemm,
    )  # fmt: skip
    record = RunRecord.create(out, label.replace("+", "_"), config={})
    source = RandomPrompts(model.config.vocab_size, args.prompt, seed=0)
    resolved = resolve_train(cfg, model, device)  # once, as `mxrl train` does
    sizes = memory_sizes(path, model, cfg, resolved.plan, args)
    trainer = FixedLengthTrainer(
        cfg, model, source, record, lengths=lengths, resolved=resolved, **sizes
    )
    # --profile-sync: one more step after the timed ones, its engine update profiled in place
    extra = 1 if args.profile_sync else 0
    trainer.profile_at = args.steps + 2 if extra else None
    rows = []
    # `mxrl train`'s run(): the heap it starts with frozen for its steps (--no-gc-freeze: not)
    with frozen_heap() if args.gc_freeze else contextlib.nullcontext():
        for step in range(args.steps + 1 + extra):
            gc_start, start = GC_PAUSES.seconds, time.perf_counter()
            metrics = trainer.train_step()
            wall = time.perf_counter() - start
            if 0 < step <= args.steps:  # step 1: the warm-up
                rows.append({"rollout_s": metrics["time/rollout_s"],
                             "train_s": metrics["time/train_s"],
                             "sync_s": metrics["time/sync_s"], "step_s": wall,
                             "response_len": metrics["response_len/mean"],
                             "gc_s": GC_PAUSES.seconds - gc_start,
                             "micro_batches": metrics["train/micro_batches"],
                             "padded_tokens_ratio": metrics["train/padded_tokens_ratio"],
                             "parts": rollout_parts(
                                 trainer.engine.stats, metrics["time/rollout_s"],
                                 step_floor_bytes(trainer.engine, trainer.last_outs, args.prompt),
                                 args.copy_gbps)})  # fmt: skip
            print(f"  {label} step {step + 1}: {wall:.2f} s", flush=True)
    if args.profile_sync:
        profile_call(functools.partial(loop_sync, trainer), device, f"loop sync {label}")
    row = {"preset": label, **{k: statistics.median(r[k] for r in rows) for k in STAGES}}
    # every timed step's seconds per stage: the spread between steps, beside the median
    row["per_step"] = {k: [r[k] for r in rows] for k in STAGES}
    row["generated_tokens"] = sum(lengths)
    row["response_len_mean"] = rows[-1]["response_len"]  # the engine's, as the loop logged it
    row.update(engine_limits(trainer.engine, args.prompt + args.new_tokens))
    row["micro_batch_tokens"] = trainer.micro_batch_tokens
    # the training pass's forwards and the tokens they ran, padding included, over the real
    # ones: the trainer's metrics (the same lengths every step)
    row["micro_batches"] = int(rows[-1]["micro_batches"])
    row["padded_tokens_ratio"] = rows[-1]["padded_tokens_ratio"]
    row["attention_split"] = trainer.engine.options.attention_split  # as the engine runs it
    row["dense_gemm"] = trainer.engine.options.dense_gemm
    row["engine_bytes"] = sum(value_nbytes(r.value) for r in trainer.engine.records())
    row["sync_gbps"] = row["engine_bytes"] / row["sync_s"] / 1e9
    row["kv_cache_gib"] = sizes["kv_cache_bytes"] / 2**30
    row["sync_phases"] = trainer.sync_phases[1 : 1 + args.steps]  # the timed steps'
    row["gc_step_s"] = [r["gc_s"] for r in rows]
    row["gc_freeze"] = args.gc_freeze
    # each timed step's rollout: its decode steps by live sequences, and the rest
    row["rollout_parts"] = [r["parts"] for r in rows]
    print(
        f"  {label} rollout by live sequences: "
        + "; ".join(
            f"{b['rows']}: {b['steps']} steps {b['s']:.2f} s ({b['ms_per_step']:.2f} ms"
            + (f", {b['x_floor']:.2f}x floor)" if "x_floor" in b else ")")
            for b in rows[-1]["parts"]["by_rows"]
        )
        + f"; other {rows[-1]['parts']['other_s']:.2f} s"
    )
    print(f"  {label} sync phases: {row['sync_phases']}; GC per step {row['gc_step_s']}")
    print(f"  {label} training: {row['micro_batches']} micro-batches of <= "
          f"{row['micro_batch_tokens']} tokens, {row['padded_tokens_ratio']:.3f}x the real tokens")  # fmt: skip
    row["peak_gib"] = (
        torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    )
    del trainer, model
    gc.collect()  # the trainer's reference cycles: its device memory back before the next preset
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return row


def loop_sync(trainer: GRPOTrainer) -> None:
    """The sync of `train_step` (its export with the loop's sampled SQNR, the engine's verified
    update, the digest) once more, as the next step's (the engine takes only later steps): for
    --profile-sync, after the timed steps."""
    step = trainer.step = trainer.step + 1
    sample = SqnrSample.at_step(step, trainer.cfg.sqnr_expert_stride)
    trainer.rollout.update(trainer.actor.export(step, sqnr=sample))
    trainer.rollout.digest()


def memory_sizes(path: Path, model, cfg: GRPOConfig, plan, args) -> dict:
    """What `mxrl train` hands its trainer from the memory estimate (`mxrl.rl.memory`, checked:
    a batch that cannot fit is refused before the first step): the training pass's micro-batch
    budget (unless `--micro-batch-tokens`), the engine's KV cache (unless `--kv-cache-gb`) and
    whether the bf16 experts' copies are held (rl.hold_bf16_weights auto)."""
    train_cfg = TrainConfig(model=str(path), rl=cfg)
    est = estimate_memory(
        model.config, plan, train_cfg, prompt_tokens=args.prompt,
        capacity=device_capacity(cfg.device),
    )  # fmt: skip
    est.check()
    kv = int(args.kv_cache_gb * 2**30) if args.kv_cache_gb else est.kv_cache
    return {
        "micro_batch_tokens": est.micro_batch_tokens,
        "kv_cache_bytes": kv,
        "hold_bf16_weights": est.hold_bf16_weights,
    }


def engine_limits(engine, longest: int) -> dict:
    """What bounds the rollout's concurrency: the scheduler's cap on sequences per step
    (`max_num_seqs`) and the KV cache's blocks (memory), as sequences of `longest` tokens."""
    cache = engine.cache_options
    blocks = engine._blocks.num_blocks if engine._blocks is not None else 0
    per_sequence = -(-longest // cache.block_size)
    return {"max_num_seqs": cache.max_num_seqs, "kv_blocks": blocks,
            "kv_sequences_at_longest": blocks // per_sequence}  # fmt: skip


def with_deltas(rows: list[dict]) -> list[dict]:
    """Each stage as Δ% against the bf16 row (None without one)."""
    base = next((r for r in rows if r["preset"] == "bf16"), None)
    for r in rows:
        for k in STAGES:
            r[f"{k[:-2]}_delta_pct"] = (
                100.0 * (r[k] / base[k] - 1.0) if base and base[k] > 0 else None
            )
    return rows


def plot_section(section: dict, path: Path) -> None:
    """The section's rows as stacked bars (rollout, train, sync and the rest of the step's wall
    time, seconds) with each step's Δ% against bf16 above its bar; a PNG at `path`."""
    from matplotlib.figure import Figure

    rows = section["rows"]
    parts = {"rollout": [r["rollout_s"] for r in rows], "train": [r["train_s"] for r in rows],
             "sync": [r["sync_s"] for r in rows]}  # fmt: skip
    parts["other"] = [r["step_s"] - sum(p[i] for p in parts.values()) for i, r in enumerate(rows)]
    fig = Figure(figsize=(1.2 * len(rows) + 2, 4.5), layout="constrained")
    ax = fig.add_subplot()
    x, bottom = range(len(rows)), [0.0] * len(rows)
    for name, values in parts.items():
        ax.bar(x, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, r in enumerate(rows):
        if r.get("step_delta_pct") is not None:
            ax.annotate(f"{r['step_delta_pct']:+.1f}%", (i, r["step_s"]), ha="center", va="bottom")
    ax.set_xticks(list(x), [r["preset"].replace("+", "\n+") for r in rows], fontsize=8)
    batch = section["batch"]
    ax.set_title(f"GRPO step, {section['model']['layers']}-layer slice, {batch['prompts']} x "
                 f"{batch['samples']}, prompt {batch['prompt_tokens']}, responses up to "
                 f"{batch['longest_response']} (mean {batch['mean_response']:.0f})", fontsize=9)  # fmt: skip
    ax.set_ylabel("seconds per step")
    ax.legend(loc="lower right", fontsize=8)
    fig.savefig(path, dpi=110)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(ARTICLE_PRESETS))
    ap.add_argument(
        "--kv-fp8",
        nargs="*",
        metavar="PRESET",
        help="these presets (none named: every one) again with kv_cache: fp8",
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=4096, help="the longest response")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    ap.add_argument("--micro-batch-tokens", type=int, help="default: the memory estimate's")
    ap.add_argument("--verify-every", type=int, default=0, help="deep sync check every N steps")
    ap.add_argument("--tile", type=int, default=128, help="the engine's GEMM tile")
    ap.add_argument("--attention-split", type=int, default=0,
                    help="rl.engine_attention_split: keys per split of the paged attention")  # fmt: skip
    ap.add_argument("--dense-gemm", default="tiles", choices=["tiles", "grouped"],
                    help="rl.engine_dense_gemm: the engine's bf16 / block-FP8 projections")  # fmt: skip
    ap.add_argument(
        "--kv-cache-gb", type=float, help="the engine's KV cache (default: the estimate's)"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny layer shapes (CPU logic check)")
    ap.add_argument("--profile-sync", action="store_true",
                    help="one more step after the timed ones, its engine update profiled in "
                         "place, then one more of the loop's syncs after the steps (printed)")  # fmt: skip
    ap.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                    help="leave the heap unfrozen during the steps (mxrl train freezes it), "
                         "for the collector's share: gc_step_s against a run without")  # fmt: skip
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "h200.json"))
    ap.add_argument("--section", default="rl_step", help="the results section written")
    ap.add_argument("--plot", metavar="PNG", help="draw --out's rl_step section there; no run")
    args = ap.parse_args(argv)
    check_presets(args.presets)
    if args.kv_fp8 is not None:
        check_presets(args.kv_fp8)
        args.kv_fp8 = args.kv_fp8 or list(args.presets)
        if not set(args.kv_fp8) <= set(args.presets):
            ap.error("--kv-fp8 names presets of --presets (each runs right after its own)")
    for name in ("layers", "prompts", "samples", "prompt", "new_tokens", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        plot_section(json.loads(Path(args.out).read_text())[args.section], Path(args.plot))
        print(f"rl_step: {args.plot}")
        return 0
    device = check_device(args.device)
    # a request's prompt and its longest response fit the model's positions (the engine
    # refuses a request that runs past them)
    positions = args.prompt + args.new_tokens
    config = model_config(layers=args.layers, vocab=args.vocab, tiny=args.tiny,
                          min_positions=positions)  # fmt: skip
    count = args.prompts * args.samples
    lengths = response_lengths(count, args.new_tokens, seed=0)
    print(f"rl_step: {args.layers} layers, {args.prompts} x {args.samples} sequences, prompt "
          f"{args.prompt}, responses {min(lengths)}..{max(lengths)} tokens "
          f"(mean {sum(lengths) / count:.0f})", flush=True)  # fmt: skip
    # the copy rate of this run (read + write), for the rollout's floor by live sequences
    args.copy_gbps = (
        copy_bandwidth(torch.empty(64 << 20, device=device))["gbps"]
        if device.type == "cuda" else None
    )  # fmt: skip
    kv = set(args.kv_fp8 or ())  # each right after its preset: the pair a cut run keeps
    runs = [(p, fp8) for p in args.presets for fp8 in (False, True) if not fp8 or p in kv]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        save_pretrained(build_model(config, dtype=torch.float32, seed=0), path)
        for preset, kv in runs:
            rows.append(run_preset(path, preset, kv, lengths, device, args, Path(tmp) / "runs"))
            write_section(rows, lengths, device, args)  # each row kept, should a later one fail
    columns = [("preset", "preset", "s")] + [
        c for k in STAGES for c in ((k, k.replace("_s", " s"), ".3f"),
                                    (f"{k[:-2]}_delta_pct", "Δ%", "+.1f"))
    ]  # fmt: skip
    print(format_table(rows, columns))
    print(f"rl_step: written to {args.out}")
    return 0 if all(math.isfinite(r["step_s"]) for r in rows) else 1


def write_section(rows: list[dict], lengths: list[int], device, args) -> None:
    """The `rl_step` section of `--out` with the rows so far (their deltas against bf16)."""
    count = len(lengths)
    rows = with_deltas(rows)
    env = environment() if device.type == "cuda" else cpu_environment()
    section = {
        "model": {"layers": args.layers, "vocab": args.vocab, "tiny": args.tiny},
        "batch": {
            "prompts": args.prompts,
            "samples": args.samples,
            "prompt_tokens": args.prompt,
            "longest_response": args.new_tokens,
            "mean_response": sum(lengths) / count,
        },
        "steps": args.steps,
        "copy_gbps": args.copy_gbps,
        "rows": rows,
        "environment": env,
        "delta_note": "Δ% = 100 x (preset / bf16 - 1), per stage",
    }
    update_results(Path(args.out), args.section, section, {})


if __name__ == "__main__":
    raise SystemExit(main())
