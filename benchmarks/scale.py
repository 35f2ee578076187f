"""Scale-out on two GPUs: the same GRPO config run in one process, split (1 train rank + 1 rollout
rank, NCCL sync) and colocated (2 ranks, FSDP2, an engine on each), step time split into rollout
/ sync / train, and the engines' bytes compared through the digests the runs record.

    python benchmarks/scale.py --layers 2 --out benchmarks/results/h200.json   # nvidia-h200-x2
    python benchmarks/scale.py --tiny --device cpu --steps 2                     # the logic, gloo

The model is a Qwen3-30B-A3B-shaped slice (`--layers` decoder layers of the real shape, random
weights; `--tiny`: tiny layers) written once as an HF directory with a character-level
`tokenizer.json`, so `mxrl train` runs it on the embedded arithmetic task exactly as a user's
checkpoint. Random weights rarely stop early: every sequence generates `--new-tokens` tokens,
which is what the timing wants. Each run is a real `mxrl train` (torchrun for two ranks); its
metrics.jsonl gives per-step `time/rollout_s`, `time/sync_s`, `time/train_s` (medians over the
steps after the first, which holds compilation and graph capture), and its `sync_verified`
events the digest of the bytes the engine(s) held after each sync: equal digests mean the
split and colocated engines hold a single-process export's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from common import ensure_repo_on_path, environment, update_results

ensure_repo_on_path()

from engine_decode import model_config  # noqa: E402

from mxrl.models import build_model, save_pretrained  # noqa: E402
from mxrl.runs import RunRecord  # noqa: E402

PLACEMENTS = {
    "single": None,
    "split": {"mode": "split", "train_ranks": 1, "rollout_ranks": 1},
    "colocated": {"mode": "colocated"},
}
CHARS = "0123456789+-*/=?.,:() \nabcdefghijklmnopqrstuvwxyz"


def write_tokenizer(path: Path) -> None:
    """A character-level tokenizer.json (and its config) for the arithmetic task."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(path / "tokenizer.json"))
    specials = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_slice(path: Path, args) -> None:
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = model_config(layers=args.layers, vocab=args.vocab, tiny=args.tiny)
    save_pretrained(build_model(config), path)
    write_tokenizer(path)


def write_config(workdir: Path, model_dir: Path | None, name: str, args) -> Path:
    raw = {
        "model": str(model_dir) if model_dir is not None else "builtin:tiny-moe",
        "data": {"source": "builtin:arithmetic"}
        | ({"warmup_steps": args.warmup_steps} if model_dir is None else {}),
        "out": str(workdir / "runs"),
        "run_id": name,
        "rl": {
            "recipe": args.recipe, "device": args.device, "steps": args.steps,
            "prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
            "max_new_tokens": args.new_tokens, "verify_every": 1,
        } | {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.rl)},
    }  # fmt: skip
    if PLACEMENTS[name] is not None:
        raw["placement"] = PLACEMENTS[name]
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run(name: str, config: Path, workdir: Path, args) -> dict:
    cmd = [sys.executable, "-m", "mxrl.cli", "train", "--config", str(config)]
    if PLACEMENTS[name] is not None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "mxrl.cli", "train", "--config", str(config)]  # fmt: skip
    log = workdir / f"{name}.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc, peak_rss = _run_measured(cmd, f, args.timeout)
    wall = time.perf_counter() - t0
    print(f"{name}: rc {rc}, {wall:.1f} s, peak RSS {peak_rss:.2f} GiB (log {log})", flush=True)
    row: dict = {"placement": name, "command": " ".join(cmd[1:]), "rc": rc, "wall_s": wall,
                 "peak_rss_gib": peak_rss}  # fmt: skip
    if rc != 0:
        row["log_tail"] = log.read_text()[-3000:]
        return row
    record = RunRecord.open(workdir / "runs" / name)
    metrics = [m for m in record.metrics() if "time/rollout_s" in m]
    later = metrics[1:] or metrics
    for key in ("rollout_s", "sync_s", "train_s"):
        row[key] = statistics.median(m[f"time/{key}"] for m in later)
    row["step_s"] = row["rollout_s"] + row["sync_s"] + row["train_s"]
    row["steps"] = len(metrics)
    per_rank = sorted({k for m in later for k in m if k.startswith("time/rank")})
    row["per_rank"] = {k[5:]: statistics.median(m[k] for m in later if k in m) for k in per_rank}
    row["rewards"] = [m.get("reward/mean") for m in metrics]
    for key in ("rollout_peak_gib", "train_peak_gib"):  # the largest over the steps
        row[key] = max((m[f"memory/{key}"] for m in metrics if f"memory/{key}" in m), default=None)
    if record.events("memory_estimate"):
        row["memory_estimate"] = record.events("memory_estimate")[0]
    row["sync_digests"] = [e.get("engine_digest") for e in record.events("sync_verified")]
    row["sync_ok"] = all(e.get("ok", False) for e in record.events("sync_verified"))
    return row


def _run_measured(cmd: list[str], out, timeout: float) -> tuple[int, float]:
    """(return code, peak resident set in GiB of the process and the children it waited for)."""
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss / (1 << 20)  # KiB on Linux
        if time.monotonic() > deadline:
            proc.kill()
        time.sleep(0.2)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tiny", action="store_true", help="tiny layer shapes (the logic on a CPU)")
    p.add_argument(
        "--builtin", action="store_true",
        help="builtin:tiny-moe after its SFT warm-up instead of a slice: rewards are non-zero, so "
        "the weights move and every sync's digest compares trained masters",
    )  # fmt: skip
    p.add_argument("--warmup-steps", type=int, default=60, help="--builtin's SFT warm-up")
    p.add_argument("--recipe", default="nvfp4-dequantized")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--rl", nargs="*", default=[], metavar="KEY=VALUE",
        help="more rl settings, e.g. max_tokens_per_micro_batch=16384 checkpoint_layers=true",
    )  # fmt: skip
    p.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    p.add_argument("--workdir", default="/tmp/mxrl-scale")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--out", default=None, help="results JSON: its `scale` section is written")
    p.add_argument("--section", default="scale", help="the results JSON key written")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = None
    if not args.builtin:
        model_dir = workdir / ("slice-tiny" if args.tiny else f"slice-{args.layers}l")
        write_slice(model_dir, args)
    rows = []
    for name in args.placements:
        rows.append(run(name, write_config(workdir, model_dir, name, args), workdir, args))
    single = next((r for r in rows if r["placement"] == "single" and r["rc"] == 0), None)
    for r in rows:
        if single is not None and r["rc"] == 0:
            r["x_single_step"] = r["step_s"] / single["step_s"]
            r["digests_equal_single"] = r["sync_digests"] == single["sync_digests"]
            r["first_digest_equal_single"] = r["sync_digests"][:1] == single["sync_digests"][:1]
    section = {
        "model": {"layers": args.layers, "vocab": args.vocab, "tiny": args.tiny,
                  "shape": "tiny" if args.tiny else "Qwen3-30B-A3B layers"}
        if not args.builtin else {"builtin": "tiny-moe", "warmup_steps": args.warmup_steps},
        "settings": {k: getattr(args, k) for k in
                     ("recipe", "device", "steps", "prompts", "samples", "new_tokens", "rl")},
        "gpus": torch.cuda.device_count(),
        "method": "mxrl train per placement; medians over steps 2.. of time/{rollout,sync,"
                  "train}_s (metrics.jsonl); digests from sync_verified events",
        "rows": rows,
    }  # fmt: skip
    for r in rows:
        if r["rc"] == 0:
            print(f"  {r['placement']:>9}: step {r['step_s']:.2f} s = rollout {r['rollout_s']:.2f}"
                  f" + sync {r['sync_s']:.3f} + train {r['train_s']:.2f}; digests equal single: "
                  f"{r.get('digests_equal_single')}; peak memory rollout "
                  f"{r['rollout_peak_gib']:.2f}, train {r['train_peak_gib']:.2f} GiB")  # fmt: skip
    if args.out:
        metadata = environment() if torch.cuda.is_available() else {}
        section["environment"] = metadata or {"device": "cpu", "torch": torch.__version__}
        update_results(Path(args.out), args.section, section, metadata)
        print(f"wrote the {args.section} section of {args.out}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    raise SystemExit(main())
