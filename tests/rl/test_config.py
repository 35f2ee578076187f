"""The train config's schema (mxrl/rl/config.py): types, ranges, what a resume does with each
field, the diff a resume records; the progress line's ETA."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import fields

import pytest

from mxrl.kernels import Backend
from mxrl.rl.config import (
    APPLY,
    BACKENDS,
    LAUNCH,
    REFUSE,
    DataConfig,
    GRPOConfig,
    LogConfig,
    TrainConfig,
    plain,
)
from mxrl.rl.grpo import Correction
from mxrl.rl.metrics import format_eta
from mxrl.rl.resume import config_changes
from mxrl.rl.stability import SpikeAction
from mxrl.runs.yamlio import dump_yaml, load_yaml
from tests.faults.harness import REPO


def _cfg(**rl) -> TrainConfig:
    return TrainConfig.from_dict({"model": "builtin:tiny-moe", "rl": rl})


def test_every_field_declares_its_check_and_its_resume_rule():
    for kind in (GRPOConfig, DataConfig, LogConfig, TrainConfig):
        for f in fields(kind):
            assert callable(f.metadata["check"]), (kind.__name__, f.name)
            assert f.metadata["on_resume"] in (APPLY, REFUSE, LAUNCH, None), f.name


def test_what_a_resume_may_change():
    """The run's identity is refused, the training process's settings apply (module doc)."""
    rule = {f.name: f.metadata["on_resume"] for f in fields(GRPOConfig)}
    refused = {name for name, how in rule.items() if how is REFUSE}
    assert refused == {"recipe", "prompts_per_step", "samples_per_prompt", "seed"}
    assert {"lr", "steps", "checkpoint_every", "eval_every", "verify_every", "grad_clip",
            "temperature", "betas"} <= {n for n, how in rule.items() if how is APPLY}  # fmt: skip
    assert all(f.metadata["on_resume"] is REFUSE for f in fields(DataConfig))
    top = {f.name: f.metadata["on_resume"] for f in fields(TrainConfig)}
    assert top == {"model": REFUSE, "dtype": REFUSE, "data": None, "rl": None, "log": None,
                   "placement": REFUSE, "out": LAUNCH, "resume": LAUNCH, "run_id": LAUNCH,
                   "strict": LAUNCH}  # fmt: skip
    assert all(f.metadata["on_resume"] is LAUNCH for f in fields(LogConfig))


def test_defaults_are_valid_and_ints_are_accepted_for_floats():
    cfg = GRPOConfig(lr=1, temperature=2, betas=[0, 0.5])
    assert (cfg.lr, cfg.temperature, cfg.betas) == (1.0, 2.0, (0.0, 0.5))
    assert type(cfg.lr) is float and type(cfg.betas) is tuple
    assert GRPOConfig(correction="none").correction is None
    assert GRPOConfig(correction="tis").correction == "tis"
    assert GRPOConfig().hold_bf16_weights == "auto" and GRPOConfig().checkpoint_layers is False
    for hold in (True, False, "auto"):
        assert GRPOConfig(hold_bf16_weights=hold).hold_bf16_weights is hold


@pytest.mark.parametrize(
    ("rl", "needle"),
    [
        ({"lr": 0}, "rl.lr: must be a finite number > 0, got 0.0"),
        ({"lr": math.nan}, "rl.lr: must be a finite number > 0, got nan"),
        ({"steps": 2.5}, "rl.steps: expected a whole number >= 1, got 2.5 (a float)"),
        ({"steps": "ten"}, "rl.steps: expected a whole number >= 1, got 'ten' (a string)"),
        ({"seed": False}, "rl.seed: expected a whole number >= 0, got False (a boolean)"),
        ({"betas": [0.9]}, "rl.betas: expected two numbers [beta1, beta2] in [0, 1)"),
        ({"betas": [-0.1, 0.9]}, "rl.betas[0]: must be a finite number in [0, 1), got -0.1"),
        ({"top_p": 0}, "rl.top_p: must be a finite number in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "rl.top_p"),
        ({"weight_decay": -1}, "rl.weight_decay: must be a finite number >= 0"),
        ({"tis_cap": 0.5}, "rl.tis_cap: must be a finite number >= 1"),
        ({"device": "gpu"}, "rl.device: expected cpu, cuda or cuda:N, got 'gpu'"),
        ({"lr": "5e-4"}, "rl.lr: expected a number > 0, got '5e-4' (a string); write it without"),
        ({"max_new_tokens": 9}, "rl.max_new_tokens: builtin:tiny-moe generates at most 8"),
        ({"recipe": ""}, "rl.recipe: expected a non-empty string"),
        ({"hold_bf16_weights": "yes"}, "rl.hold_bf16_weights: expected true, false or auto"),
        ({"hold_bf16_weights": 1}, "rl.hold_bf16_weights: expected true, false or auto"),
    ],
)
def test_bad_values_name_the_field_the_value_and_the_fix(rl, needle):
    with pytest.raises(ValueError) as err:
        _cfg(**rl)
    assert needle in str(err.value)


def test_the_file_is_named_and_the_closest_key_suggested(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("model: builtin:tiny-moe\nrl:\n  temprature: 1\n")
    with pytest.raises(
        ValueError, match=r"t.yaml: rl.temprature: unknown key; did you mean .temperature."
    ):
        TrainConfig.load(path)
    path.write_text("model: builtin:tiny-moe\nrl:\n  lr: 1e-3\n  lr: 1e-2\n")
    with pytest.raises(ValueError, match=r"t.yaml: line 4: duplicate key 'lr'"):
        TrainConfig.load(path)


def test_cross_field_checks():
    with pytest.raises(ValueError, match=r"data\.source: builtin:tiny-moe has a character"):
        TrainConfig.from_dict({"model": "builtin:tiny-moe", "data": {"source": "d.jsonl"}})
    with pytest.raises(ValueError, match=r"rl\.eval_every: 5 needs a held-out set"):
        TrainConfig.from_dict(
            {"model": "m", "data": {"source": "d.jsonl"}, "rl": {"eval_every": 5}}
        )
    with pytest.raises(ValueError, match="out: 'elsewhere' but resume continues the run"):
        TrainConfig.from_dict({"model": "m", "resume": "runs/a", "out": "elsewhere"})
    TrainConfig.from_dict({"model": "m", "resume": "runs/a", "out": "runs", "run_id": "a"})


def test_backend_choices_are_the_kernels_backends():
    assert set(BACKENDS) - {None} == {b.value for b in Backend}


CHOSEN = {"correction": "tis", "spike_action": "skip", "compute_dtype": "bfloat16",
          "backend": "reference"}  # fmt: skip


def test_closed_sets_are_enums_read_from_and_written_as_their_spellings():
    rl = _cfg(**CHOSEN).rl
    assert rl.correction is Correction.TIS and rl.spike_action is SpikeAction.SKIP
    assert rl.compute_dtype == "bfloat16" and type(rl.compute_dtype).__name__ == "ComputeDtype"
    assert rl.backend is Backend.REFERENCE and GRPOConfig().backend is None
    assert GRPOConfig(correction=Correction.MIS).correction is Correction.MIS
    written = plain(rl)  # what a checkpoint holds; TrainConfig.to_dict for config.yaml
    assert {k: written[k] for k in CHOSEN} == CHOSEN
    assert all(type(written[k]) is str for k in CHOSEN)
    text = dump_yaml(_cfg(**CHOSEN).to_dict())
    assert "  correction: tis\n" in text and "  spike_action: skip\n" in text
    assert "  compute_dtype: bfloat16\n" in text and "  backend: reference\n" in text


def test_a_resume_compares_enums_with_the_strings_a_run_wrote():
    """A run's config.yaml and checkpoint hold strings (and held them before the enums): read
    back, an unchanged setting is no change; a changed one is described by its spelling."""
    old = TrainConfig.from_dict(load_yaml(dump_yaml(_cfg(**CHOSEN).to_dict())))
    assert config_changes(old, _cfg(**CHOSEN)) == []
    (change,) = config_changes(old, _cfg(**{**CHOSEN, "correction": "mis"}))
    assert (change.old, change.new) == ("tis", "mis") and type(change.new) is str
    assert change.describe() == "rl.correction 'tis' -> 'mis'"


def test_an_unknown_rl_key_is_refused_naming_it():
    """`extra` was a declared, never read field; the schema now refuses it as any unknown key."""
    with pytest.raises(ValueError, match=r"^rl\.extra: unknown key; .*the keys of rl are recipe"):
        _cfg(extra={"note": "x"})


def test_config_changes_name_each_setting_and_its_rule():
    old = _cfg(lr=1e-3, seed=0)
    new = TrainConfig.from_dict({"model": "builtin:tiny-moe", "rl": {"lr": 1e-2, "seed": 3},
                                 "data": {"warmup_steps": 7}, "out": "x", "strict": False})  # fmt: skip
    got = [(c.field, c.old, c.new, c.on_resume) for c in config_changes(old, new)]
    assert got == [
        ("data.warmup_steps", 300, 7, REFUSE),
        ("rl.lr", 1e-3, 1e-2, APPLY),
        ("rl.seed", 0, 3, REFUSE),
    ]  # out and strict are LAUNCH settings: not compared
    assert config_changes(old, old) == []


def test_the_schema_loads_without_torch():
    """A config error is reported before torch (seconds of imports) is loaded."""
    code = (
        "import sys; from mxrl.rl.config import TrainConfig;"
        "TrainConfig.from_dict({'model': 'builtin:tiny-moe', 'rl': {'lr': 1e-3}});"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_yaml_file_with_exponent_floats():
    cfg = TrainConfig.from_dict(load_yaml("model: builtin:tiny-moe\nrl: {lr: 5e-4, tis_cap: 2e0}"))
    assert (cfg.rl.lr, cfg.rl.tis_cap) == (0.0005, 2.0)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.4, "0s"), (59.6, "1m00s"), (61, "1m01s"), (3599, "59m59s"), (3600, "1h00m"),
     (7322, "2h02m"), (-3, "0s")],
)  # fmt: skip
def test_eta(seconds, text):
    assert format_eta(seconds) == text
