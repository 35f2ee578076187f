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
    out: runs                        # run records are written under it (the default)
    resume: null                     # a run directory: continue from its last checkpoint
    strict: true                     # refuse a recipe that does not do what it says here
    log:
      tensorboard: false             # also TensorBoard files under runs/<id>/tensorboard/
    rl:                              # GRPOConfig fields (mxrl/rl/config.py)
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

The file is checked against one schema (`mxrl.rl.config.TrainConfig`: every value typed and
range-checked, unknown and duplicate keys refused) before anything else; then the environment
(device, files, folders), the recipe's plan on the model's config and, for a resume, everything
that can refuse it (`mxrl.rl.resume`): all before a warm-up, a model load or a file write.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mxrl.app.data import PromptDataset, encode_prompt
from mxrl.app.preflight import Checked, preflight, read_dataset
from mxrl.app.rewards import load_reward
from mxrl.app.sources import DatasetSource, TaskSource
from mxrl.app.task import ArithmeticTask
from mxrl.app.warmup import warmed_up_model
from mxrl.arch import ModelConfig, builtin_config
from mxrl.models import from_pretrained, load_tokenizer
from mxrl.recipe import Plan
from mxrl.rl.config import BUILTIN_MODEL, BUILTIN_SOURCE, TrainConfig
from mxrl.rl.resolve import resolve_train
from mxrl.rl.resume import ResumePoint
from mxrl.rl.trainer import GRPOTrainer
from mxrl.runs import RunRecord
from mxrl.runs.tensorboard import attach_tensorboard

if TYPE_CHECKING:
    from mxrl.parallel import Layout

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(
    cfg: TrainConfig, device: str | torch.device, dataset: PromptDataset | None = None
) -> tuple[Any, Any]:
    """(model on `device` in the config's dtype, prompt source); the built-in model's SFT
    warm-up runs here (or loads from its cache). `dataset`: the one `preflight` read (else
    read here); either way before the model is loaded."""
    data, dtype = cfg.data, DTYPES[cfg.dtype]
    if cfg.model == BUILTIN_MODEL:
        task = ArithmeticTask(seed=data.seed)
        model, _ = warmed_up_model(builtin_config("tiny-moe"), task, data.warmup_steps)
        return model.to(device=device, dtype=dtype), TaskSource(ArithmeticTask(seed=data.seed + 1))
    if dataset is None and data.source != BUILTIN_SOURCE:
        dataset = read_dataset(cfg)
    tokenizer = load_tokenizer(cfg.model)
    assert tokenizer is not None  # check_paths saw its tokenizer.json
    if dataset is not None:
        dataset = _without_overlong(dataset, tokenizer, cfg)
    model = from_pretrained(cfg.model, dtype=dtype, device=device)
    if dataset is None:
        return model, TaskSource(ArithmeticTask(tokenizer=tokenizer))
    return model, DatasetSource(dataset, tokenizer, load_reward(data.reward))


def _without_overlong(dataset: PromptDataset, tokenizer: Any, cfg: TrainConfig) -> PromptDataset:
    """verl's filter_overlong_prompts: a prompt whose tokens and rl.max_new_tokens exceed the
    model's max_position_embeddings (config.json) is skipped, as a malformed row is."""
    limit = ModelConfig.from_hf(cfg.model).max_positions
    if limit is None:
        return dataset
    budget = limit - cfg.rl.max_new_tokens

    def too_long(example) -> str | None:
        n = len(encode_prompt(example.prompt, tokenizer))
        if n <= budget:
            return None
        return (f"prompt too long: {n} tokens + rl.max_new_tokens {cfg.rl.max_new_tokens} > "
                f"max_position_embeddings {limit}")  # fmt: skip

    return dataset.keeping(too_long)


def _check_built(plan: Plan, built: Plan) -> None:
    """The plan checked before the build (on the model's config) is the run's, resolved once
    on the built model's parameters (`resolve_train`), which the trainer applies."""
    if built.hash() != plan.hash():
        raise RuntimeError(
            f"the plan resolved on the model's config ({plan.hash()[:12]}) is not the one on "
            f"its parameters ({built.hash()[:12]}): tensors_from_hf_config does not describe "
            "this model's parameters (a bug)"
        )


def run_train(config: str | Path | TrainConfig, checked: Checked | None = None) -> RunRecord | None:
    """One `mxrl train` run (a config file, or its TrainConfig; `checked`: its `preflight`, if
    the caller made it); with a `placement` section, this process's part of a torchrun job (the
    RunRecord on rank 0, None on the other ranks). Every rank made the same checks on the same
    files (`preflight`), so a refusal stopped every rank before the process group exists."""
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.load(config)
    checked = checked if checked is not None else preflight(cfg)
    if cfg.placement is None:
        return _run(cfg, checked, None)
    from mxrl.parallel import Layout  # torch.distributed: imported only for a torchrun launch

    layout = Layout.init(cfg.placement, device=cfg.rl.device)
    try:
        record = _run(cfg, checked, layout)
        torch.distributed.barrier()
        return record
    finally:
        layout.close()


def _run(cfg: TrainConfig, checked: Checked, layout: Layout | None) -> RunRecord | None:
    """This process's run: one process (`layout` None) or a rank of a placement."""
    plan, point = checked.plan, checked.resume
    device = cfg.rl.device if layout is None else layout.device
    writer = layout is None or layout.is_writer
    memory = checked.memory
    sizes: dict[str, Any] = {}  # the estimate's micro-batch budget and KV cache for the trainer
    if memory is not None:
        sizes = {
            "micro_batch_tokens": memory.micro_batch_tokens,
            "kv_cache_bytes": memory.kv_cache,
            "hold_bf16_weights": memory.hold_bf16_weights,
        }
        for line in memory.lines() if writer else ():
            logger.info("mxrl train: %s", line)
    model, source = _build_in_turn(cfg, device, checked.dataset, layout)
    resolved = resolve_train(cfg.rl, model, device)  # the run's choices, made once
    _check_built(plan, resolved.plan)
    fp8_source = fp8_source_report(cfg, model, resolved.plan) if writer else None
    backend = str(resolved.kernels.quantizer)
    if point is not None:
        # nothing is written to the old run until the trainer holds its checkpoint
        record = RunRecord.open(point.run_dir) if writer else None
        trainer = GRPOTrainer(
            cfg.rl, model, source, record, layout=layout, resolved=resolved, **sizes
        )
        trainer.load_checkpoint(point.checkpoint, point.state)
        point.state.clear()  # its tensors: the trainer holds its own copies now
        if record is not None:
            if cfg.log.tensorboard:  # a new event file; TensorBoard hides the old one's later steps
                attach_tensorboard(record, first_step=point.step + 1)
            _resume_record(record, point, backend)
            _record_memory(record, memory, point.step)
            _record_fp8_source(record, fp8_source, point.step)
    elif not writer:
        trainer = GRPOTrainer(
            cfg.rl, model, source, None, layout=layout, resolved=resolved, **sizes
        )
    else:
        if layout is not None:
            logger.info("mxrl train: %d ranks (%s)", layout.world_size, layout.placement.mode)
        record = RunRecord.create(
            cfg.out_dir, cfg.run_id, config=cfg.to_dict(), plan_json=plan, backend=backend
        )
        if cfg.log.tensorboard:
            attach_tensorboard(record, plan=plan)
        _record_memory(record, memory, 0)
        _record_fp8_source(record, fp8_source, 0)
        with record.guard(lambda: 0):  # a failure before step 1 is recorded too
            trainer = GRPOTrainer(
                cfg.rl, model, source, record, layout=layout, resolved=resolved, **sizes
            )
        skipped = getattr(getattr(source, "dataset", None), "skipped", [])
        if skipped:
            record.log_skipped_rows(
                0, len(skipped), [f"row {s.row}: {s.reason}" for s in skipped[:5]]
            )
    trainer.run()
    return trainer.record


def _build_in_turn(
    cfg: TrainConfig, device: str | torch.device, dataset: Any, layout: Layout | None
) -> tuple[Any, Any]:
    """`build`; under a placement rank 0 first (a builtin model's SFT warm-up writes its cache
    once), the others then read the cache instead of training the same warm-up concurrently."""
    if layout is None:
        return build(cfg, device, dataset)
    if layout.rank != 0:
        torch.distributed.barrier()
    built = build(cfg, device, dataset)
    if layout.rank == 0:
        torch.distributed.barrier()
    return built


def _record_memory(record: RunRecord, memory: Any, step: int) -> None:
    """The memory estimate (`mxrl.rl.memory`) as a `memory_estimate` event of the run record."""
    if memory is not None:
        record.log_event("memory_estimate", step, **memory.fields())


def fp8_source_report(cfg: TrainConfig, model: torch.nn.Module, plan: Plan) -> Any:
    """For a model loaded from an HF fine-grained FP8 checkpoint: how many of its blocks the
    plan's quantization gives back byte for byte (`mxrl.weights.fp8_source`), logged as one
    INFO line; None for any other model."""
    if cfg.model == BUILTIN_MODEL:
        return None
    from mxrl.weights.fp8_source import compare_with_source

    report = compare_with_source(cfg.model, plan, model)
    if report is not None:
        logger.info("mxrl train: %s", report.line())
    return report


def _record_fp8_source(record: RunRecord, report: Any, step: int) -> None:
    """The FP8 source report as an `fp8_source` event of the run record."""
    if report is not None:
        record.log_event("fp8_source", step, **report.fields())


def _resume_record(record: RunRecord, point: ResumePoint, backend: str) -> None:
    record.resume(
        point.step, checkpoint=point.checkpoint, backend=backend,
        config=point.config.to_dict(), changes=point.change_events(),
    )  # fmt: skip
