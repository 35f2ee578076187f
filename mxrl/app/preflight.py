"""Everything `mxrl train` checks before any work (a warm-up, a model load, a file written):
what the config's schema cannot know — the files and folders it names, the device, the kernel
backend, the reward function —, the recipe's plan on the model's config, and a resume's checks.

    checked = preflight(cfg)   # ValueError naming the field; nothing is created or written
    checked.plan, checked.resume, checked.memory

Nothing heavy is imported before it is needed: the path checks come first and import nothing,
so a bad `out:` or a missing file is refused at once; then torch (device, plan, checkpoint), and
last the memory the run needs (`mxrl.rl.memory`): a config that cannot fit is refused here, not
by an out-of-memory error mid-run.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mxrl.rl.config import BUILTIN_MODEL, BUILTIN_SOURCE, TrainConfig
from mxrl.rl.resume import ResumePoint, prepare_resume
from mxrl.runs import is_run_dir
from mxrl.runs.record import check_writable
from mxrl.runs.tensorboard import require_tensorboard

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checked:
    """A config that passed every check: its plan (a `mxrl.recipe.Plan`), for a resume where
    and how the run continues, the prompt dataset it names (read and validated; None for the
    built-in task) and its memory estimate (`mxrl.rl.memory.MemoryEstimate`)."""

    plan: Any
    resume: ResumePoint | None
    dataset: Any = None
    memory: Any = None


def preflight(cfg: TrainConfig) -> Checked:
    """Every check, in order: the launch, the TensorBoard package (if asked for) and the
    paths, the dataset (none of them imports torch),
    the device and the reward, the plan, the resume, the memory."""
    check_launch(cfg)
    if cfg.log.tensorboard:
        require_tensorboard("log.tensorboard (--tensorboard)")
    check_paths(cfg)
    dataset = read_dataset(cfg)
    check_environment(cfg)
    plan = config_plan(cfg)
    resume = None
    if cfg.resume is not None:
        resume = prepare_resume(cfg, plan.hash(), distributed=cfg.placement is not None)
    return Checked(plan, resume, dataset, check_memory(cfg, plan, dataset))


def check_memory(cfg: TrainConfig, plan: Any, dataset: Any) -> Any:
    """The run's memory estimate on its device (`mxrl.rl.memory`), refused if it cannot fit."""
    from mxrl.arch import ModelConfig, builtin_config
    from mxrl.rl import memory

    model_cfg = ModelConfig.from_hf(
        builtin_config("tiny-moe") if cfg.model == BUILTIN_MODEL else cfg.model
    )
    estimate = memory.estimate_memory(
        model_cfg, plan, cfg, prompt_tokens=longest_prompt(cfg, dataset, model_cfg),
        capacity=memory.device_capacity(cfg.rl.device),
    )  # fmt: skip
    estimate.check()
    return estimate


# the longest prompts by characters whose tokens are counted (tokenizing every row is the
# build's work; token counts follow character counts closely enough for an estimate)
LONGEST_ROWS = 16


def longest_prompt(cfg: TrainConfig, dataset: Any, model_cfg: Any) -> int:
    """The longest prompt's tokens: the built-in task's longest problem, or the longest of the
    dataset's LONGEST_ROWS longest rows tokenized as `mxrl.app.data.encode_prompt` does,
    capped where the build skips a longer prompt (max_position_embeddings)."""
    from mxrl.app.data import encode_prompt
    from mxrl.app.task import ArithmeticTask, Problem
    from mxrl.models import load_tokenizer

    tokenizer = None if cfg.model == BUILTIN_MODEL else load_tokenizer(cfg.model)
    if dataset is None:
        task = ArithmeticTask(tokenizer=tokenizer)
        m = task.max_operand
        return max(len(task.encode_prompt(Problem(m, op, m))) for op in task.ops)
    rows = sorted(dataset.examples, key=lambda e: len(str(e.prompt)), reverse=True)
    longest = max(len(encode_prompt(e.prompt, tokenizer)) for e in rows[:LONGEST_ROWS])
    if model_cfg.max_positions is not None:
        longest = min(longest, model_cfg.max_positions - cfg.rl.max_new_tokens)
    return longest


def read_dataset(cfg: TrainConfig) -> Any:
    """The prompt dataset, read and its rows validated (`mxrl.app.data.PromptDataset`) before
    torch is imported: a file with no usable row is refused in a second, not after a model's
    load. None for the built-in task."""
    if cfg.data.source == BUILTIN_SOURCE:
        return None
    from mxrl.app.data import PromptDataset

    data = cfg.data
    try:
        return PromptDataset.from_file(
            data.source, data.prompt_key, data.label_key, seed=cfg.rl.seed
        )
    except ValueError as e:
        raise ValueError(f"data.source: {e}") from None


def check_launch(cfg: TrainConfig) -> None:
    """A torchrun launch needs a placement section."""
    if cfg.placement is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            f"placement: launched by torchrun with WORLD_SIZE {os.environ['WORLD_SIZE']} but "
            "the config has no placement section; add one (docs/scale.md) or run one process"
        )


def check_environment(cfg: TrainConfig) -> None:
    """The device and the reward function; ValueError naming the field, its value and the
    fix."""
    check_device(cfg)
    if cfg.data.source != BUILTIN_SOURCE:
        from mxrl.app.rewards import load_reward

        try:
            load_reward(cfg.data.reward)
        except ValueError as e:
            raise ValueError(f"data.reward: {e}") from None


def check_paths(cfg: TrainConfig) -> None:
    """The model folder, the data file, the run folder to resume, or where a new run goes."""
    if cfg.model != BUILTIN_MODEL:
        model = Path(cfg.model)
        if not (model / "config.json").is_file():
            raise ValueError(
                f"model: {cfg.model!r} is not an HF checkpoint folder (no config.json in it); "
                f"pass one, or {BUILTIN_MODEL}"
            )
        if not (model / "tokenizer.json").is_file():
            raise ValueError(f"model: {cfg.model!r} has no tokenizer.json; a train run needs one")
    if cfg.data.source != BUILTIN_SOURCE and not Path(cfg.data.source).is_file():
        raise ValueError(f"data.source: {cfg.data.source!r}: no such file")
    if cfg.resume is not None:
        if not is_run_dir(Path(cfg.resume)):
            raise ValueError(
                f"resume: {cfg.resume!r} is not a run folder (no config.yaml or env.json); pass "
                "a run's folder, e.g. runs/<run id>"
            )
        check_writable(cfg.resume, "resume")
        return
    check_writable(cfg.out_dir, "out")
    if cfg.run_id is not None and (cfg.out_dir / cfg.run_id).exists():
        raise ValueError(
            f"run_id: {str(cfg.out_dir / cfg.run_id)!r} already exists; choose another run_id, "
            "or resume: it"
        )


def check_device(cfg: TrainConfig) -> None:
    """The device exists in this torch, and the kernel backend runs on it."""
    import torch

    from mxrl.kernels import select_backend

    device = torch.device(cfg.rl.device)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(
                f"rl.device: {cfg.rl.device} but this torch ({torch.__version__}) sees {count} "
                "CUDA device(s); set rl.device: cpu, or run where the GPU is"
            )
    try:
        select_backend(cfg.rl.backend, device)
    except ValueError as e:
        raise ValueError(f"rl.backend: {e}") from None


def config_plan(cfg: TrainConfig) -> Any:
    """The recipe resolved on the model's config — its parameters' names and shapes in the
    fused expert layout mxrl's models hold, which is what the trainer resolves on — and checked
    (`strict`), before the model is built."""
    from mxrl.arch import builtin_config, load_hf_config, tensors_from_hf_config
    from mxrl.recipe import resolve

    config = builtin_config("tiny-moe") if cfg.model == BUILTIN_MODEL else cfg.model
    hf_config = load_hf_config(config)
    check_positions(hf_config, cfg.rl.max_new_tokens)
    if cfg.model != BUILTIN_MODEL:  # a quantization_config mxrl does not load, before the load
        from mxrl.models.hf_fp8 import fp8_config

        try:
            fp8_config(hf_config, Path(cfg.model) / "config.json")
        except ValueError as e:
            raise ValueError(f"model: {e}") from None
    try:
        plan = resolve(cfg.rl.recipe, tensors_from_hf_config(hf_config, "fused"))
        logger.info("mxrl train: recipe %s, plan %s\n%s", plan.recipe_name, plan.hash()[:12],
                    plan.summary())  # fmt: skip
        plan.check(strict=cfg.strict)
    except ValueError as e:
        raise ValueError(f"rl.recipe: {e}") from None
    return plan


def check_positions(hf_config: dict, max_new_tokens: int) -> None:
    """No prompt fits when max_new_tokens alone fills the model's max_position_embeddings (the
    positions it was trained for); longer prompts than the rest are skipped as the dataset is
    read (`rl.train.build`)."""
    limit = hf_config.get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and max_new_tokens >= limit:
        raise ValueError(
            f"rl.max_new_tokens: {max_new_tokens} leaves no room for a prompt in the model's "
            f"max_position_embeddings {limit} (config.json); set it below {limit}"
        )
