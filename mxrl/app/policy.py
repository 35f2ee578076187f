"""A run's trained policy, out of mxrl: `mxrl convert --model runs/<id>` exports the master
weights of the run's newest checkpoint (one process's `.pt` or a torchrun run's DCP folder) as a
quantized or served checkpoint, and checks the bytes against the engine the run rolled out with.

Each checkpoint records the digest of the weights its engine held after that step's sync
(`engine_digest`: sha256 over every tensor's name and checksum). Exported under the run's own
plan, the same master gives the same records, so the export's digest must equal it: that is
checked, and a mismatch is an error (the bytes would not be the policy's). Under another recipe
(e.g. a bf16 run served in FP8) there is nothing to compare, and the CLI says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mxrl.arch import ModelConfig, builtin_config, load_hf_config, tensors_from_hf_config
from mxrl.models import empty_model
from mxrl.recipe import resolve
from mxrl.rl.config import BUILTIN_MODEL, TrainConfig
from mxrl.rl.resume import CHECKPOINT_DIR, latest_checkpoint, read_state, recorded_config
from mxrl.runs.record import CONFIG_FILE
from mxrl.weights.convert import Exported, export_checkpoint
from mxrl.weights.served import served_format

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def is_run_dir(path: str | Path) -> bool:
    """A run record folder with checkpoints (what `mxrl train` writes under runs/<id>)."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / CHECKPOINT_DIR).is_dir()


@dataclass(frozen=True)
class RunPolicy:
    """The newest checkpoint of a run, before its weights are read."""

    run_dir: Path
    checkpoint: Path
    distributed: bool  # a DCP folder (a torchrun run) rather than a .pt file
    step: int
    config: TrainConfig
    plan_hash: str  # the plan the run trained and rolled out under
    engine_digest: str | None  # the engine's weights after this step's sync

    @property
    def source_dir(self) -> Path | None:
        """The HF checkpoint the run started from (its tokenizer travels), None for builtin."""
        return None if self.config.model == BUILTIN_MODEL else Path(self.config.model)

    def model_config(self) -> ModelConfig:
        if self.source_dir is None:
            return ModelConfig.from_hf(builtin_config("tiny-moe"))
        return ModelConfig.from_hf(self.source_dir)

    def hf_config(self) -> dict[str, Any]:
        """config.json for the export: the source's (its token ids, rope scaling...), else the
        builtin model's."""
        if self.source_dir is None:
            return self.model_config().to_hf(dtype=self.config.dtype)
        return load_hf_config(self.source_dir)

    def load(self) -> torch.nn.Module:
        """The master weights at this step, in the run's dtype, on the CPU."""
        model = empty_model(self.model_config(), dtype=DTYPES[self.config.dtype])
        if self.distributed:
            from mxrl.parallel import dcp

            dcp.load_model(self.checkpoint, model)
        else:
            state = read_state(self.checkpoint, distributed=False)
            model.load_state_dict(state["model"])
        return model.eval()


def find_policy(run_dir: str | Path) -> RunPolicy:
    """The newest checkpoint of `run_dir`, its settings checked (ValueError naming the fix)."""
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise ValueError(f"{run_dir} is not a run folder with checkpoints (runs/<id>)")
    pt = latest_checkpoint(run_dir)
    folders = sorted(
        p for p in (run_dir / CHECKPOINT_DIR).glob("step_*") if p.is_dir() and not p.suffix
    )
    candidates = [(p, False) for p in [pt] if p is not None]
    candidates += [(p, True) for p in folders[-1:]]
    if not candidates:
        raise ValueError(
            f"{run_dir} has no checkpoint under {CHECKPOINT_DIR}/ (written every "
            "rl.checkpoint_every steps); train with rl.checkpoint_every set"
        )
    checkpoint, distributed = max(candidates, key=lambda c: c[0].name.split(".")[0])
    try:
        state = read_state(checkpoint, distributed=distributed)
        config = recorded_config(run_dir, state)
    except ValueError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise ValueError(
            f"checkpoint {checkpoint} does not load ({type(e).__name__}: {e}); delete it to "
            "export the one before"
        ) from None
    source = None if config.model == BUILTIN_MODEL else Path(config.model)
    if source is not None and not (source / "config.json").is_file():
        raise ValueError(
            f"the run started from {source}, which is gone: its config.json describes the "
            "policy's architecture; put it back at that path"
        )
    return RunPolicy(
        run_dir,
        checkpoint,
        distributed,
        int(state["step"]),
        config,
        str(state["plan_hash"]),
        state.get("engine_digest"),
    )


def export_policy(
    policy: RunPolicy,
    out_dir: str | Path,
    *,
    recipe: Any = None,
    to: str = "mxrl",
    shard_bytes: int | str = "2GB",
    overwrite: bool = False,
    strict: bool = True,
    on_plan: Any = None,
    progress: bool | None = None,
) -> tuple[Exported, bool]:
    """Export the policy under `recipe` (None: the run's own); returns what was written and
    whether its bytes were checked against the run's engine (only under the run's own plan,
    where a mismatch is refused before anything is in place). The plan is checked, and for
    `to="hf"` its served layout, before the weights are read."""
    recipe = policy.config.rl.recipe if recipe is None else recipe
    hf = policy.hf_config()
    plan = resolve(recipe, tensors_from_hf_config(hf, expert_layout="fused"))
    if on_plan is not None:
        on_plan(plan)
    plan.check(strict=strict)
    if to == "hf":
        served_format(plan)
    own = plan.hash() == policy.plan_hash
    expect = policy.engine_digest if own else None
    model = policy.load()
    exported = export_checkpoint(
        model,
        resolve(recipe, {n: p.shape for n, p in model.named_parameters()}),
        {**hf, "torch_dtype": policy.config.dtype},
        out_dir,
        shard_bytes=shard_bytes,
        overwrite=overwrite,
        progress=progress,
        to=to,
        copy_files_from=policy.source_dir,
        expect_digest=expect,
    )
    return exported, expect is not None


def convert_run(
    run_dir: str | Path, out_dir: str | Path, *, say: Callable[[str], None], **kwargs: Any
) -> Path:
    """`mxrl convert --model runs/<id>`: find the newest checkpoint, export it (`export_policy`,
    kwargs), and `say` what was checked."""
    policy = find_policy(run_dir)
    kind = "DCP folder" if policy.distributed else "checkpoint"
    say(f"mxrl convert: {run_dir}: step {policy.step} ({kind} {policy.checkpoint.name})")
    exported, checked = export_policy(policy, out_dir, **kwargs)
    served = " (served checkpoint)" if kwargs.get("to") == "hf" else ""
    say(f"mxrl convert: {run_dir} -> {exported.path}{served}")
    if checked:
        say(
            f"the bytes are the engine's after step {policy.step} (digest "
            f"{policy.engine_digest[:16]}, recorded in the run's checkpoint)"
        )
    else:
        say(
            "a plan other than the run's: these bytes were never rolled out by the run (nothing "
            "to check them against)"
        )
    return exported.path
