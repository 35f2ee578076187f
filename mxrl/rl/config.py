"""The `mxrl train` config as one typed schema (docs/rl.md, "The train config").

    cfg = TrainConfig.load("train.yaml")      # every value typed and range-checked, or ValueError
    cfg.rl.lr, cfg.data.source, cfg.placement

Every field is declared once, with its default, its check and what a resume does with a changed
value (`OnResume`, in the field's metadata):

- APPLY: a setting of the training process (lr, steps, the loss's knobs, intervals, ...): a
  resume with another value applies it from the first resumed step and records a
  `config_change` event;
- REFUSE: what the run *is* (model, recipe, dtype, seed, batch shape, data, placement): a resume
  with another value is refused, naming the field, both values and the fix;
- LAUNCH: how this launch finds its run (out, run_id, resume) and how strictly it checks the
  recipe: read at every start, not part of the run.

Nothing here imports torch: a config error is reported before the heavy imports. Closed sets
are enums (`mxrl.rl.choices`; `kernels.Backend` imported only when a config names one).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mxrl.rl.checks import Check, boolean, choice, integer, number, optional_text, show, text
from mxrl.rl.choices import ComputeDtype, Correction, SpikeAction
from mxrl.runs.yamlio import load_yaml

if TYPE_CHECKING:
    from mxrl.kernels import Backend

BUILTIN_MODEL = "builtin:tiny-moe"
BUILTIN_SOURCE = "builtin:arithmetic"
# the built-in task's answers are a few characters and an EOS: `mxrl train` used to cap the
# setting at 8 without a word (the record said one value, the run used another); now it refuses
BUILTIN_MAX_NEW_TOKENS = 8
BACKENDS = (None, "reference", "triton")  # mxrl.kernels.Backend's values; None: by device
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class OnResume(StrEnum):
    """What a resume does with a value that differs from the run's (module docstring)."""

    APPLY = "apply"
    REFUSE = "refuse"
    LAUNCH = "launch"


def rule(on_resume: OnResume | None, check: Check) -> dict[str, Any]:
    """A schema field's metadata: what a resume does with a changed value (None: a section,
    whose own fields decide) and the check of its value."""
    return {"on_resume": on_resume, "check": check}


# --- checks ---------------------------------------------------------------------------------


def _recipe(path: str, value: Any) -> str | dict:
    if isinstance(value, Mapping):
        return dict(value)  # an inline recipe; resolved (and checked) with the model
    return text(path, value)


def _correction(path: str, value: Any) -> Correction | None:
    value = None if value == "none" else value
    return choice(None, *Correction, why=" (none: no rollout correction)")(path, value)


def _betas(path: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(
            f"{path}: expected two numbers [beta1, beta2] in [0, 1), got {show(value)}; "
            "AdamW's default is [0.9, 0.999]"
        )
    beta = number(0.0, 1.0, low_open=False)
    return (beta(f"{path}[0]", value[0]), beta(f"{path}[1]", value[1]))


def _device(path: str, value: Any) -> str:
    if not isinstance(value, str) or not _DEVICE.fullmatch(value):
        raise ValueError(f"{path}: expected cpu, cuda or cuda:N, got {show(value)}")
    return value


def _run_id(path: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or value in (".", "..") or "/" in value:
        raise ValueError(f"{path}: expected a folder name without '/', got {show(value)}")
    return value


def _backend(path: str, value: Any) -> Backend | None:
    if _BACKEND(path, value) is None:
        return None
    from mxrl.kernels import Backend  # torch: only for a config that names a backend

    return Backend(value)


def _placement(path: str, value: Any) -> Any:
    if value is None:
        return None
    from mxrl.parallel.placement import Placement  # torch.distributed: only for a placement

    if isinstance(value, Placement):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{path}: expected a mapping (docs/scale.md), got {show(value)}")
    return Placement.from_dict(dict(value), path)


APPLY, REFUSE, LAUNCH = OnResume.APPLY, OnResume.REFUSE, OnResume.LAUNCH
AUTO = "auto"  # rl.hold_bf16_weights: held where the run fits with the copies (mxrl.rl.memory)
POSITIVE = {"low": 0.0, "low_open": True}
_GROUP = integer(2, " (GRPO normalises rewards within a prompt's group of samples)")
# RL samples: at 0 (greedy) every sample of a group gives the same answer (no advantage),
# and the trainer's logprobs divide by the temperature
_TEMPERATURE = number(**POSITIVE, why=" (sampling; greedy decoding leaves GRPO no signal)")
_TOP_P = number(0.0, 1.0, low_open=True, high_open=False)
# 0 would scale every gradient to nothing: a run whose weights never change
_GRAD_CLIP = number(**POSITIVE, why=" (the largest gradient norm a step may take)")
# below 1 even on-policy tokens (ratio 1) would be down-weighted (TIS) or dropped (MIS)
_TIS_CAP = number(1.0, low_open=False, why=" (the largest importance weight kept)")
# GradSpikeDetector flags nothing before 10 norms of history (its min_history)
_SPIKE_WINDOW = integer(10, " (the spike detector's 10 steps of history)")
_BACKEND = choice(*BACKENDS, why=" (null: by device)")
_ACTION, _DTYPE = choice(*SpikeAction), choice(*ComputeDtype)
_EVERY = integer(0, " (0: never)")
_WHOLE = integer(0)
_DENSE_GEMM = choice("tiles", "grouped")  # mxrl.engine.config.DENSE_GEMMS (not imported here)
_TILE = integer(1, " (null: the engine's default for the device)")


def _engine_tile(path: str, value: Any) -> int | None:
    return None if value is None else _TILE(path, value)


def _attention_split(path: str, value: Any) -> int:
    """0, or a positive multiple of the engine's KV block (16 tokens): rl.engine_attention_split."""
    value = _WHOLE(path, value)
    if value % 16:
        raise ValueError(
            f"{path}: must be 0 (one pass) or a multiple of the KV block size 16 (e.g. 512), "
            f"got {value}"
        )
    return value


def _hold(path: str, value: Any) -> bool | str:
    """true, false or auto (rl.hold_bf16_weights)."""
    if isinstance(value, bool) or value == AUTO:
        return value
    raise ValueError(f"{path}: expected true, false or auto, got {show(value)}")


# --- the schema -----------------------------------------------------------------------------


@dataclass(frozen=True)
class GRPOConfig:
    """The RL settings, the `rl:` section (defaults: docs/design.md §8)."""

    recipe: str | dict = field(default="bf16", metadata=rule(REFUSE, _recipe))
    steps: int = field(default=20, metadata=rule(APPLY, integer(1)))
    prompts_per_step: int = field(default=16, metadata=rule(REFUSE, integer(1)))
    samples_per_prompt: int = field(default=8, metadata=rule(REFUSE, _GROUP))
    max_new_tokens: int = field(default=8, metadata=rule(APPLY, integer(1)))
    temperature: float = field(default=1.0, metadata=rule(APPLY, _TEMPERATURE))
    top_p: float = field(default=1.0, metadata=rule(APPLY, _TOP_P))
    top_k: int = field(default=0, metadata=rule(APPLY, integer(0, " (0: off)")))
    lr: float = field(default=1e-4, metadata=rule(APPLY, number(**POSITIVE)))
    weight_decay: float = field(default=0.0, metadata=rule(APPLY, number(0.0, low_open=False)))
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata=rule(APPLY, _betas))
    grad_clip: float = field(default=1.0, metadata=rule(APPLY, _GRAD_CLIP))
    eps_low: float = field(default=0.2, metadata=rule(APPLY, number(0.0, 1.0, low_open=True)))
    eps_high: float = field(default=0.28, metadata=rule(APPLY, number(**POSITIVE)))
    std_normalize: bool = field(default=True, metadata=rule(APPLY, boolean))
    correction: Correction | None = field(default=None, metadata=rule(APPLY, _correction))
    tis_cap: float = field(default=2.0, metadata=rule(APPLY, _TIS_CAP))
    spike_window: int = field(default=50, metadata=rule(APPLY, _SPIKE_WINDOW))
    spike_z: float = field(default=6.0, metadata=rule(APPLY, number(**POSITIVE)))
    spike_action: SpikeAction = field(default=SpikeAction.LOG, metadata=rule(APPLY, _ACTION))
    seed: int = field(default=0, metadata=rule(REFUSE, integer(0)))
    device: str = field(default="cpu", metadata=rule(APPLY, _device))
    backend: Backend | None = field(default=None, metadata=rule(APPLY, _backend))
    checkpoint_every: int = field(default=0, metadata=rule(APPLY, _EVERY))
    verify_every: int = field(default=10, metadata=rule(APPLY, _EVERY))
    # each step's per-layer SQNR measures group (step mod this) of this many contiguous groups
    # of every expert stack's experts (1: all; mxrl/weights/event.py): 1/16 of the expert bytes
    sqnr_expert_stride: int = field(default=16, metadata=rule(APPLY, integer(1)))
    eval_every: int = field(default=0, metadata=rule(APPLY, _EVERY))
    # rows per engine GEMM tile; null: the engine's default for the device (128 on CUDA, where
    # a decode step of up to 128 sequences is one launch reading each weight once; 32 on the CPU)
    engine_tile: int | None = field(default=None, metadata=rule(APPLY, _engine_tile))
    # keys per split of the engine's Triton paged attention (0: one pass; docs/engine.md,
    # "Attention"): batch-invariant, faster at long contexts, not the one-pass bytes
    engine_attention_split: int = field(default=0, metadata=rule(APPLY, _attention_split))
    # the engine's bf16 / block-FP8 projections: tiles (one launch per tile) or grouped (one
    # launch for a step's rows on sm90+; docs/engine.md): both batch-invariant, the same bytes
    # not guaranteed
    engine_dense_gemm: str = field(default="tiles", metadata=rule(APPLY, _DENSE_GEMM))
    # the engine's compute dtype and the training forward's autocast: auto = bfloat16 on CUDA
    # (the CUDA-graph decode, tensor-core training GEMMs), float32 on the CPU (the reference)
    compute_dtype: ComputeDtype = field(default=ComputeDtype.AUTO, metadata=rule(APPLY, _DTYPE))
    # the training pass runs the step's sequences in micro-batches of at most this many padded
    # tokens (sequences x the longest one), gradients accumulated; 0: derived from the memory
    # left once weights, optimizer and rollout are placed (mxrl.rl.memory); the loss is the
    # whole batch's either way (docs/rl.md, "Memory")
    max_tokens_per_micro_batch: int = field(
        default=0, metadata=rule(APPLY, integer(0, " (0: derived from memory)"))
    )
    # recompute each decoder layer in the backward: activations of one layer per micro-batch
    # instead of all of them, for one more forward (the knob when a sequence alone does not fit)
    checkpoint_layers: bool = field(default=False, metadata=rule(APPLY, boolean))
    # the routed experts' bf16 grouped GEMMs (CUDA) cast each fp32 master once per optimizer
    # step and hold the copy (2 bytes a weight) for every micro-batch's forward and dgrad and
    # the logprob passes, instead of casting it for each of them; on one process only (FSDP2
    # casts its gathered shards per use). auto: held where the run fits with the copies
    # (mxrl.rl.memory decides), else cast
    hold_bf16_weights: bool | str = field(default=AUTO, metadata=rule(APPLY, _hold))

    def __post_init__(self) -> None:
        _validate(self, "rl.")


@dataclass(frozen=True)
class DataConfig:
    """The prompts and the reward, the `data:` section."""

    source: str = field(default=BUILTIN_SOURCE, metadata=rule(REFUSE, text))
    prompt_key: str = field(default="prompt", metadata=rule(REFUSE, text))
    label_key: str = field(default="label", metadata=rule(REFUSE, text))
    reward: str = field(default="math", metadata=rule(REFUSE, text))
    warmup_steps: int = field(default=300, metadata=rule(REFUSE, integer(0)))
    seed: int = field(default=0, metadata=rule(REFUSE, integer(0)))

    def __post_init__(self) -> None:
        _validate(self, "data.")


@dataclass(frozen=True)
class LogConfig:
    """Where the run's metrics and events go besides its record, the `log:` section: a launch
    setting (a resume may turn it on or off)."""

    # TensorBoard event files under runs/<id>/tensorboard/ (docs/runs.md, "TensorBoard"); needs
    # the optional tensorboard package (`mxrl train --tensorboard` turns it on too)
    tensorboard: bool = field(default=False, metadata=rule(LAUNCH, boolean))

    def __post_init__(self) -> None:
        _validate(self, "log.")


def _section(path: str, value: Any) -> Any:
    """A `data:`, `rl:` or `log:` section from a mapping (absent or null: every default)."""
    kind = {"data": DataConfig, "rl": GRPOConfig, "log": LogConfig}[path]
    if isinstance(value, kind):
        return value
    value = {} if value is None else value
    if not isinstance(value, Mapping):
        raise ValueError(f"{path}: expected a mapping of settings, got {show(value)}")
    _check_keys(value, kind, f"{path}.")
    return kind(**value)


@dataclass(frozen=True)
class TrainConfig:
    """A whole `mxrl train` file (mxrl/app/train.py has an example)."""

    model: str = field(default=None, metadata=rule(REFUSE, text))
    dtype: str = field(default="float32", metadata=rule(REFUSE, choice("float32", "bfloat16")))
    data: DataConfig = field(default_factory=DataConfig, metadata=rule(None, _section))
    rl: GRPOConfig = field(default_factory=GRPOConfig, metadata=rule(None, _section))
    log: LogConfig = field(default_factory=LogConfig, metadata=rule(None, _section))
    placement: Any = field(default=None, metadata=rule(REFUSE, _placement))  # a Placement
    out: str | None = field(default=None, metadata=rule(LAUNCH, optional_text))  # None: runs
    resume: str | None = field(default=None, metadata=rule(LAUNCH, optional_text))
    run_id: str | None = field(default=None, metadata=rule(LAUNCH, _run_id))
    strict: bool = field(default=True, metadata=rule(LAUNCH, boolean))

    def __post_init__(self) -> None:
        _validate(self, "")
        builtin = self.model == BUILTIN_MODEL
        if builtin and self.data.source != BUILTIN_SOURCE:
            raise ValueError(
                f"data.source: {self.model} has a character vocabulary and trains on "
                f"{BUILTIN_SOURCE} only, got {self.data.source!r}; use an HF model for a dataset"
            )
        if builtin and self.rl.max_new_tokens > BUILTIN_MAX_NEW_TOKENS:
            raise ValueError(
                f"rl.max_new_tokens: {self.model} generates at most {BUILTIN_MAX_NEW_TOKENS} "
                f"tokens (an answer of a few characters and an EOS), got "
                f"{self.rl.max_new_tokens}; set rl.max_new_tokens <= {BUILTIN_MAX_NEW_TOKENS}"
            )
        if self.rl.eval_every and self.data.source != BUILTIN_SOURCE:
            raise ValueError(
                f"rl.eval_every: {self.rl.eval_every} needs a held-out set, which only "
                f"{BUILTIN_SOURCE} has (a dataset has none); set rl.eval_every: 0"
            )
        if self.resume is not None:
            _check_resume_location(self)

    @property
    def out_dir(self) -> Path:
        return Path(self.out if self.out is not None else "runs")

    @classmethod
    def from_dict(cls, raw: Any) -> TrainConfig:
        """The config from parsed YAML: unknown keys and bad values name their field path."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"expected a mapping of settings at the top level, got {show(raw)}")
        _check_keys(raw, cls, "")
        if raw.get("model") is None:
            raise ValueError(f"model: required: an HF checkpoint directory or {BUILTIN_MODEL}")
        return cls(**raw)

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        """The YAML file, checked; ValueError '<file>: <field path>: <problem and fix>'."""
        path = Path(path)
        try:
            return cls.from_dict(load_yaml(path, str(path)))
        except ValueError as e:
            message = str(e)
            prefixed = message if message.startswith(str(path)) else f"{path}: {message}"
            raise ValueError(prefixed) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain values (what config.yaml holds): sections and the placement as mappings."""
        return plain(self)


def plain(config: Any) -> dict[str, Any]:
    """`dataclasses.asdict` of a config with each enum member as its value (the YAML spelling):
    what config.yaml and a checkpoint hold."""
    return dataclasses.asdict(config, dict_factory=_plain_values)


def _plain_values(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {k: v.value if isinstance(v, Enum) else v for k, v in items}


def _validate(obj: Any, prefix: str) -> None:
    for f in fields(obj):
        value = f.metadata["check"](prefix + f.name, getattr(obj, f.name))
        object.__setattr__(obj, f.name, value)


def _check_keys(section: Mapping[str, Any], kind: type, prefix: str) -> None:
    allowed = [f.name for f in fields(kind)]
    for key in section:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            where = prefix.rstrip(".") or "the top level"
            raise ValueError(
                f"{prefix}{key}: unknown key; {hint}the keys of {where} are {', '.join(allowed)}"
            )


def _check_resume_location(cfg: TrainConfig) -> None:
    """A resumed run continues in its own folder: `run_id` and `out`, if given, must agree."""
    folder = Path(cfg.resume).absolute()
    if cfg.run_id is not None and cfg.run_id != folder.name:
        raise ValueError(
            f"run_id: {cfg.run_id!r} but resume continues the run {str(cfg.resume)!r} in its "
            "folder; drop run_id (a resumed run keeps its folder), or drop resume: to start a "
            "new run"
        )
    if cfg.out is not None and Path(cfg.out).absolute() != folder.parent:
        raise ValueError(
            f"out: {cfg.out!r} but resume continues the run {str(cfg.resume)!r}, which lies "
            f"in {str(folder.parent)!r}; drop out"
        )
