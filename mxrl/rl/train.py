"""`mxrl train --config FILE`: a real run from a YAML file, with the same loop and records as
the demo.

    model: path/to/hf_dir            # or builtin:tiny-moe
    dtype: float32                   # master weights
    data:
      source: data/dapo-math-17k.parquet   # or builtin:arithmetic
      prompt_key: prompt
      label_key: reward_model.ground_truth
      reward: math                   # math | exact_match | integer | package.module:function
      warmup_steps: 300              # builtin:arithmetic only (cached SFT warm-up)
    out: runs                        # run records are written under it
    resume: null                     # a run directory: continue from its last checkpoint
    strict: true                     # refuse a recipe that does not do what it says here
    rl:                              # GRPOConfig fields (mxrl/rl/loop.py)
      recipe: nvfp4-dequantized
      steps: 200
      prompts_per_step: 32
      samples_per_prompt: 8
      max_new_tokens: 1024
      checkpoint_every: 20
    placement:                       # several processes (docs/scale.md); absent: one process
      mode: split                    # colocated | split
      train_ranks: 1                 # split: ranks 0.. train (FSDP2), the next ones serve
      rollout_ranks: 1
      backend: auto                  # auto | gloo | nccl

With a placement the run is launched by torchrun, `torchrun --nproc-per-node 2 $(which mxrl)
train --config FILE`; every rank reads the same file, rank 0 writes the run record, and
`resume` takes a distributed checkpoint (a `checkpoints/step_NNNNNN/` folder).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch
import yaml

from mxrl.kernels import select_backend
from mxrl.models import CharTokenizer, from_pretrained, load_tokenizer
from mxrl.parallel.placement import Placement
from mxrl.recipe import builtin_config, resolve
from mxrl.rl.data import PromptDataset
from mxrl.rl.loop import CHECKPOINT_DIR, GRPOConfig, GRPOTrainer, latest_checkpoint
from mxrl.rl.rewards import load_reward
from mxrl.rl.sources import DatasetSource, TaskSource
from mxrl.rl.task import ArithmeticTask
from mxrl.rl.warmup import warmed_up_model
from mxrl.runs import RunRecord

logger = logging.getLogger(__name__)

TOP_KEYS = {"model", "dtype", "data", "out", "resume", "rl", "run_id", "strict", "placement"}
DATA_KEYS = {"source", "prompt_key", "label_key", "reward", "warmup_steps", "seed"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_config(path: str | Path) -> dict[str, Any]:
    """The YAML file, checked: unknown keys and bad values name themselves and the fix."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"cannot read train config {path}: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    _check_keys(raw, TOP_KEYS, str(path))
    data = raw.get("data") or {}
    _check_keys(data, DATA_KEYS, f"{path}: data")
    rl = raw.get("rl") or {}
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    _check_keys(rl, fields, f"{path}: rl")
    if "model" not in raw:
        raise ValueError(f"{path}: `model` is required (an HF directory or builtin:tiny-moe)")
    if raw.get("dtype", "float32") not in DTYPES:
        raise ValueError(f"{path}: dtype must be one of {sorted(DTYPES)}")
    if "betas" in rl:
        rl["betas"] = tuple(rl["betas"])
    if "placement" in raw:
        Placement.from_dict(raw["placement"], f"{path}: placement")  # checked before any launch
    return raw


def _check_keys(section: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _build(raw: dict[str, Any], cfg: GRPOConfig) -> tuple[Any, Any, GRPOConfig]:
    """(model on cfg.device in the config's dtype, prompt source, cfg) from the YAML."""
    data = raw.get("data") or {}
    dtype = DTYPES[raw.get("dtype", "float32")]
    source_name = data.get("source", "builtin:arithmetic")
    if raw["model"] == "builtin:tiny-moe":
        task = ArithmeticTask(seed=int(data.get("seed", 0)))
        if source_name != "builtin:arithmetic":
            raise ValueError("builtin:tiny-moe has a character vocabulary: use builtin:arithmetic")
        model, _ = warmed_up_model(
            builtin_config("tiny-moe"), task, int(data.get("warmup_steps", 300))
        )
        model = model.to(device=cfg.device, dtype=dtype)
        source = TaskSource(ArithmeticTask(seed=int(data.get("seed", 0)) + 1))
    else:
        model = from_pretrained(raw["model"], dtype=dtype, device=cfg.device)
        tokenizer = load_tokenizer(raw["model"])
        if tokenizer is None:
            raise ValueError(f"{raw['model']} has no tokenizer.json: a dataset run needs one")
        if source_name == "builtin:arithmetic":
            source = TaskSource(ArithmeticTask(tokenizer=tokenizer))
        else:
            dataset = PromptDataset.from_file(
                source_name, data.get("prompt_key", "prompt"), data.get("label_key", "label"),
                seed=cfg.seed,
            )  # fmt: skip
            source = DatasetSource(dataset, tokenizer, load_reward(data.get("reward", "math")))
    if isinstance(getattr(source, "task", None), ArithmeticTask) and isinstance(
        source.task.tokenizer, CharTokenizer
    ):
        cfg = dataclasses.replace(cfg, max_new_tokens=min(cfg.max_new_tokens, 8))
    return model, source, cfg


def run_train(path: str | Path) -> RunRecord | None:
    """One `mxrl train` run; with a `placement` section, this process's part of a torchrun
    job (the RunRecord on rank 0, None on the other ranks)."""
    raw = load_config(path)
    if "placement" in raw:
        return _run_distributed(raw, path)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            f"{path}: launched by torchrun with WORLD_SIZE {os.environ['WORLD_SIZE']} but the "
            "config has no placement section; add one (docs/scale.md) or run one process"
        )
    cfg = GRPOConfig(**(raw.get("rl") or {}))
    model, source, cfg = _build(raw, cfg)
    plan = resolve(cfg.recipe, {n: p.shape for n, p in model.named_parameters()})
    logger.info("mxrl train: recipe %s, plan %s\n%s", plan.recipe_name, plan.hash()[:12],
                plan.summary())  # fmt: skip
    strict = raw.get("strict", True)
    if not isinstance(strict, bool):
        raise ValueError(f"{path}: strict must be true or false, got {strict!r}")
    plan.check(strict=strict)  # before any run directory is written
    resume = raw.get("resume")
    if resume:
        ckpt = latest_checkpoint(resume)
        if ckpt is None:
            raise ValueError(f"resume: no checkpoint under {resume}/checkpoints")
        step = int(torch.load(ckpt, map_location="cpu", weights_only=False)["step"])
        backend = str(select_backend(cfg.backend, cfg.device))
        record = RunRecord.open(resume, resume_from=step, checkpoint=ckpt, backend=backend)
        with record.guard(lambda: step):
            trainer = GRPOTrainer(cfg, model, source, record)
            trainer.load_checkpoint(ckpt)
    else:
        record = RunRecord.create(
            raw.get("out", "runs"), raw.get("run_id"), config=raw, plan_json=plan,
            backend=str(select_backend(cfg.backend, cfg.device)),
        )  # fmt: skip
        with record.guard(lambda: 0):  # a failure before step 1 is recorded too
            trainer = GRPOTrainer(cfg, model, source, record)
        skipped = getattr(getattr(source, "dataset", None), "skipped", [])
        if skipped:
            record.log_skipped_rows(
                0, len(skipped), [f"row {s.row}: {s.reason}" for s in skipped[:5]]
            )
    trainer.run()
    return record


def _run_distributed(raw: dict[str, Any], path: str | Path) -> RunRecord | None:
    """This rank's part of a torchrun job (mxrl/rl/distributed.py, docs/scale.md)."""
    from mxrl.parallel import Layout
    from mxrl.parallel import checkpoint as dcp_checkpoint
    from mxrl.rl.distributed import DistributedGRPOTrainer

    placement = Placement.from_dict(raw["placement"], f"{path}: placement")
    cfg = GRPOConfig(**(raw.get("rl") or {}))
    layout = Layout.init(placement, device=cfg.device)
    try:
        cfg = dataclasses.replace(cfg, device=str(layout.device))
        # rank 0 builds first (a builtin model's SFT warm-up writes its cache once); the others
        # then read the cache instead of training the same warm-up concurrently
        if layout.rank != 0:
            torch.distributed.barrier()
        model, source, cfg = _build(raw, cfg)
        if layout.rank == 0:
            torch.distributed.barrier()
        plan = resolve(cfg.recipe, {n: p.shape for n, p in model.named_parameters()})
        strict = raw.get("strict", True)
        if not isinstance(strict, bool):
            raise ValueError(f"{path}: strict must be true or false, got {strict!r}")
        plan.check(strict=strict)
        backend = str(select_backend(cfg.backend, cfg.device))
        resume = raw.get("resume")
        record = None
        if resume:
            ckpt = dcp_checkpoint.latest(resume, CHECKPOINT_DIR)
            if ckpt is None:
                raise ValueError(
                    f"resume: no distributed checkpoint (step_NNNNNN/ folder) under "
                    f"{resume}/{CHECKPOINT_DIR}"
                )
            step = int(dcp_checkpoint.trainer_state(ckpt)["step"])
            if layout.is_writer:
                record = RunRecord.open(resume, resume_from=step, checkpoint=ckpt, backend=backend)
            trainer = DistributedGRPOTrainer(cfg, model, source, record, layout)
            trainer.load_checkpoint(ckpt)
        else:
            if layout.is_writer:
                logger.info("mxrl train: recipe %s, plan %s, %d ranks (%s)", plan.recipe_name,
                            plan.hash()[:12], layout.world_size, placement.mode)  # fmt: skip
                record = RunRecord.create(
                    raw.get("out", "runs"), raw.get("run_id"), config=raw, plan_json=plan,
                    backend=backend,
                )  # fmt: skip
            trainer = DistributedGRPOTrainer(cfg, model, source, record, layout)
        trainer.run()
        torch.distributed.barrier()
        return record
    finally:
        layout.close()
