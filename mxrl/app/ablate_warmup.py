"""The SFT warm-up of `mxrl ablate` (mxrl.app.ablate): the demo's `sft`, on the ablation's device,
stopped when the greedy accuracy on the task's dev split (held out from training, and not the
eval set, so the choice of where to stop never looks at the problems the report scores) reaches
`warmup_target`, or at `warmup_max_steps`, or once `warmup_max_seconds` have passed (checked
with the dev accuracy). The weights are cached under the warm-up cache (`warmup.cache_dir()`,
MXRL_CACHE overrides), keyed by everything they depend on, so a second invocation on the same
machine skips the warm-up; the runs read the file (a worker process loads it itself instead of
being sent 450 MB of weights).

The GPU warm-up is not shipped as the demo's is (450 MB); it is trained on the GPU, in bf16
autocast (`CausalLM.set_training_options`), where it takes well under the 2 minutes it may.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from mxrl import __version__
from mxrl.app.multistep import MultiStepTask
from mxrl.app.warmup import cache_dir, greedy_accuracy, sft
from mxrl.engine import CacheOptions
from mxrl.models import build_model

if TYPE_CHECKING:
    from mxrl.app.ablate import AblationSettings

logger = logging.getLogger("mxrl.app.demo")

# the settings the warm-up's weights depend on (its cache key holds them)
_WARMUP_FIELDS = ("warmup_batch", "warmup_lr", "warmup_target", "warmup_check_every",
                  "warmup_max_steps", "warmup_max_seconds", "device")  # fmt: skip


def warmup_cache_key(config: dict, task: MultiStepTask, settings: AblationSettings) -> str:
    source = json.dumps(
        {"config": config, "task": task.state_dict() | {"positions": None}, "eval": task.eval_size,
         "settings": {k: getattr(settings, k) for k in _WARMUP_FIELDS}, "mxrl": __version__},
        sort_keys=True, default=str,
    )  # fmt: skip
    return "ablate-" + hashlib.sha256(source.encode()).hexdigest()[:16]


def warm_start(config: dict, task: MultiStepTask, settings: AblationSettings) -> tuple[Path, dict]:
    """(the warmed weights' safetensors file, info: steps, final_loss, dev_accuracy, the dev
    accuracy at each check, seconds, source "cache" or "trained")."""
    folder = cache_dir() / "warmup"
    key = warmup_cache_key(config, task, settings)
    weights, meta = folder / f"{key}.safetensors", folder / f"{key}.json"
    if weights.exists() and meta.exists():
        try:
            info = json.loads(meta.read_text()) | {"source": "cache"}
            logger.info("ablate: warm-up from the cache %s", weights)
            return weights, info
        except (OSError, ValueError) as err:
            logger.warning("ablate: warm-up cache %s unreadable (%s): training it", meta, err)
    model, info = _train(config, task, settings)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = weights.with_suffix(".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp))
    tmp.rename(weights)
    meta.write_text(json.dumps(info, indent=2))
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the runs' processes get the memory the warm-up held
    return weights, info | {"source": "trained"}


def _train(config: dict, task: MultiStepTask, settings: AblationSettings):
    device = torch.device(settings.device)
    model = build_model(config, seed=0, device=device)  # initialised where it trains
    if device.type == "cuda":
        model.set_training_options(compute_dtype=torch.bfloat16)
    fresh = task.fresh()
    dev = fresh.dev_problems()
    # each check builds an engine: no CUDA graphs to capture for 5 decode steps of 200 prompts
    engine = {"cache": CacheOptions(kv_cache_bytes=settings.kv_cache_bytes), "cuda_graphs": False}
    checks: list[list] = []  # [step, dev accuracy]
    t0 = time.perf_counter()

    def stop(step: int) -> bool:
        accuracy = greedy_accuracy(model, fresh, problems=dev, **engine)
        checks.append([step, accuracy])
        seconds = time.perf_counter() - t0
        logger.info("ablate: warm-up step %d, dev accuracy %.2f (%.0f s)", step, accuracy, seconds)
        return accuracy >= settings.warmup_target or seconds >= settings.warmup_max_seconds

    losses = sft(
        model, fresh, settings.warmup_max_steps, settings.warmup_batch, settings.warmup_lr,
        stop=stop, stop_every=settings.warmup_check_every,
    )  # fmt: skip
    if not checks or checks[-1][0] != len(losses):
        checks.append([len(losses), greedy_accuracy(model, fresh, problems=dev, **engine)])
    model.set_training_options(compute_dtype=None)  # the trainer sets its own
    info = {
        "steps": len(losses),
        "final_loss": losses[-1],
        "dev_accuracy": checks[-1][1],
        "checks": checks,
        "seconds": time.perf_counter() - t0,
        "target": settings.warmup_target,
    }
    return model, info
