"""`resume:` in a train config: every check that can refuse a resume, before anything is written.

    point = prepare_resume(cfg, plan.hash(), distributed=False)   # ValueError: nothing touched
    ... build the model and the trainer, trainer.load_checkpoint(point.checkpoint, point.state)
    record.resume(point.step, checkpoint=point.checkpoint, config=point.config.to_dict(),
                  changes=point.change_events())

The checks, in order: the folder is a run; it holds a checkpoint of the launch's kind (a `.pt`
file for one process, a DCP folder under a placement) and the checkpoint loads; the run's
settings (its config.yaml, with the rl settings the checkpoint was trained under) against this
config: a REFUSE field that changed is refused naming the field, both values and the fix, an
APPLY field is kept as a change to record (`mxrl.rl.config.OnResume`); the plan hash; `rl.steps`
not below the checkpoint's step. Only then does the caller open the record for writing
(`RunRecord.resume`: truncation, config.yaml, the resume and config_change events). The single-
process and the torchrun trainer share this; each loads its checkpoint its own way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any

from mxrl.rl.config import LAUNCH, REFUSE, GRPOConfig, OnResume, TrainConfig, plain
from mxrl.runs import RunRecord, is_run_dir

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"  # under the run folder: step_NNNNNN.pt, or DCP step_NNNNNN/


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest single-process checkpoint of a run (None: it has none)."""
    found = sorted((Path(run_dir) / CHECKPOINT_DIR).glob("step_*.pt"))
    return found[-1] if found else None


@dataclass(frozen=True)
class ResumePoint:
    """A resume that passed every check: where, from which step, with which changes."""

    run_dir: Path
    checkpoint: Path
    step: int
    state: dict[str, Any]  # the .pt checkpoint (one process) or the DCP trainer state
    config: TrainConfig  # what the run continues with: this launch's config, in its folder
    changes: tuple[ConfigChange, ...]  # the APPLY settings that differ from the run's

    def change_events(self) -> list[dict[str, Any]]:
        return [{"field": c.field, "old": c.old, "new": c.new} for c in self.changes]


def prepare_resume(cfg: TrainConfig, plan_hash: str, *, distributed: bool) -> ResumePoint:
    """Check that `cfg` (with `resume:` set, its paths checked: `mxrl.app.preflight`) can
    continue its run; ValueError naming what cannot, before anything is written. `plan_hash`:
    the plan this config resolves."""
    assert cfg.resume is not None
    run_dir = Path(cfg.resume)
    assert is_run_dir(run_dir), "mxrl.app.preflight.check_paths refuses a folder that is no run"
    ckpt, state = _load_latest(run_dir, distributed)
    step = int(state["step"])
    old = recorded_config(run_dir, state)
    changes = config_changes(old, cfg)
    refused = [c for c in changes if c.on_resume is REFUSE]
    if refused:
        listed = ", ".join(c.describe() for c in refused)
        raise ValueError(
            f"resume: {listed} cannot change in a resumed run (the model, recipe, dtype, seed, "
            "batch shape, data and placement are what the run is); set back the run's value "
            f"(see {run_dir / 'config.yaml'}), or start a new run (drop resume:)"
        )
    if state["plan_hash"] != plan_hash:
        raise ValueError(
            f"resume: checkpoint {ckpt} was trained under plan {state['plan_hash'][:12]}, this "
            f"config resolves plan {plan_hash[:12]} (the recipe file or the model changed); "
            "resume with the run's recipe and model, or start a new run (drop resume:)"
        )
    if cfg.rl.steps < step:
        raise ValueError(
            f"rl.steps: {cfg.rl.steps} is below step {step} of the checkpoint {ckpt}; set "
            f"rl.steps >= {step} (the total, not the steps to add)"
        )
    folder = run_dir.absolute()
    continued = dataclasses.replace(cfg, out=str(folder.parent), run_id=folder.name)
    applied = tuple(c for c in changes if c.on_resume is not REFUSE)
    for c in applied:
        logger.info("resume: %s, from step %d", c.describe(), step + 1)
    return ResumePoint(run_dir, ckpt, step, state, continued, applied)


def _load_latest(run_dir: Path, distributed: bool) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint of the launch's kind and its state; ValueError if there is none
    or it does not load."""
    pt = latest_checkpoint(run_dir)
    if distributed:  # torch.distributed.checkpoint: imported only for a torchrun launch
        from mxrl.parallel import dcp

        ckpt, other = dcp.latest(run_dir, CHECKPOINT_DIR), pt
    else:
        folders = [p for p in (run_dir / CHECKPOINT_DIR).glob("step_*") if p.is_dir()]
        ckpt, other = pt, max(folders, default=None)
    if ckpt is None and other is not None:
        kind = "a single-process" if distributed else "a distributed (DCP)"
        fix = "drop placement:" if distributed else "add the run's placement: section"
        raise ValueError(
            f"resume: {run_dir} holds {kind} checkpoint ({other}), which this launch cannot "
            f"load; resume it as it ran ({fix})"
        )
    if ckpt is None:
        raise ValueError(
            f"resume: {run_dir} has no checkpoint to resume from (checkpoints are written "
            f"under {run_dir / CHECKPOINT_DIR} every rl.checkpoint_every steps); start a new "
            "run (drop resume:)"
        )
    try:
        state = read_state(ckpt, distributed=distributed)
        missing = {"step", "plan_hash", "config"} - set(state)
        if missing:
            raise KeyError(f"no {sorted(missing)}")
    except Exception as e:  # a truncated or foreign file: any unpickling error says the same
        raise ValueError(
            f"resume: checkpoint {ckpt} does not load ({type(e).__name__}: {e}); delete it to "
            "resume from the one before, or start a new run (drop resume:)"
        ) from None
    return ckpt, state


def read_state(path: Path, *, distributed: bool, map_location: Any = "cpu") -> dict[str, Any]:
    """The trainer state of a checkpoint: a DCP folder's rank-0 state under a placement (every
    rank reads it: a shared file system), else a `.pt` file."""
    if distributed:
        from mxrl.parallel import dcp

        return dcp.trainer_state(path)
    import torch

    return torch.load(path, map_location=map_location, weights_only=False)


def recorded_config(run_dir: Path, state: Mapping[str, Any]) -> TrainConfig:
    """The settings the checkpoint was trained under: the run's config.yaml (what the run is
    never changes), with the rl section the checkpoint saved (the truth at its step, whatever
    a later resume wrote into config.yaml)."""
    recorded = RunRecord.open(run_dir).config
    known = {f.name for f in fields(GRPOConfig)}
    rl = {k: v for k, v in dict(state["config"]).items() if k in known}
    try:
        return TrainConfig.from_dict({**_top_level(recorded), "rl": rl})
    except ValueError as e:
        raise ValueError(
            f"resume: the run's recorded settings ({run_dir / 'config.yaml'} and its "
            f"checkpoint's) do not validate: {e}; start a new run (drop resume:)"
        ) from None


def _top_level(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a config mapping, LAUNCH fields and unknown keys left out."""
    keep = {f.name for f in fields(TrainConfig) if f.metadata["on_resume"] is not LAUNCH}
    return {k: v for k, v in raw.items() if k in keep}


@dataclass(frozen=True)
class ConfigChange:
    """One setting whose value differs from the resumed run's."""

    field: str  # the field path, e.g. rl.lr
    old: Any
    new: Any
    on_resume: OnResume

    def describe(self) -> str:
        return f"{self.field} {self.old!r} -> {self.new!r}"


def config_changes(old: TrainConfig, new: TrainConfig) -> list[ConfigChange]:
    """Every APPLY and REFUSE setting whose value differs, by field path (LAUNCH ones aside)."""
    return list(_diff(old, new, ""))


def _diff(old: Any, new: Any, prefix: str):
    for f in fields(new):
        path, a, b = prefix + f.name, getattr(old, f.name), getattr(new, f.name)
        how = f.metadata["on_resume"]
        if how is None:  # a section: its own fields decide
            yield from _diff(a, b, path + ".")
        elif how is not LAUNCH and a != b:
            if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
                a, b = plain(a), plain(b)
                for key in [k for k in b if a.get(k) != b[k]]:
                    yield ConfigChange(f"{path}.{key}", a.get(key), b[key], how)
            else:
                yield ConfigChange(path, _plain(a), _plain(b), how)


def _plain(value: Any) -> Any:
    """A value as config.yaml spells it: a mapping, a list, an enum's value."""
    if dataclasses.is_dataclass(value):
        return plain(value)
    if isinstance(value, Enum):
        return value.value
    return list(value) if isinstance(value, tuple) else value


def apply_optimizer_settings(opt: Any, cfg: GRPOConfig) -> None:
    """lr, betas and weight decay of `cfg` into every param group of an AdamW: after
    `load_state_dict`, which restores the checkpoint's, so a resume trains with the config's."""
    for group in opt.param_groups:
        group["lr"], group["betas"], group["weight_decay"] = cfg.lr, cfg.betas, cfg.weight_decay
