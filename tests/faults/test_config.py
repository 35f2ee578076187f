"""The faults corpus of configs, recipes, resumes and command lines: each case is a user error
that `mxrl` must refuse with exit code 2 and one `mxrl: error:` line naming the culprit (a field
path, a file, a flag), before it writes, creates or changes anything (tests/faults/harness.py).

Every case gets a folder of its own (its config, the recipe, an `afile`, and for a resume a copy
of one finished tiny run), snapshotted before and after; the warm-up cache points into it, so a
case that started the warm-up before refusing would show as a created file. The cases run as
child processes, several at once. The resume that must *apply* a changed setting is the last
test: it trains one more step.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
import torch
import yaml

from mxrl.arch import builtin_config
from mxrl.cli import main
from mxrl.models import build_model, save_pretrained
from mxrl.rl.config import GRPOConfig, TrainConfig
from mxrl.runs import RunRecord
from mxrl.runs.yamlio import load_yaml
from tests.faults.harness import Result, assert_refused, run_mxrl, snapshot

RECIPE = "name: mine\ndefault: bf16\nrules:\n  - match: {kind: router}\n    format: bf16\n"
# the same name and path, another plan: what a resumed run must not silently train under
OTHER_RECIPE = "name: mine\nrules:\n  - match: {kind: attention}\n    format: mxfp8\n"
RL = {"recipe": "recipe.yaml", "steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
      "max_new_tokens": 4, "checkpoint_every": 1, "engine_tile": 16, "lr": 1e-3, "seed": 0}  # fmt: skip
BASE = {"model": "builtin:tiny-moe", "data": {"source": "builtin:arithmetic", "warmup_steps": 1},
        "out": "runs", "rl": RL}  # fmt: skip
RESUME = {"resume": "runs/done"}
TRAIN = ("train", "--config", "train.yaml")


def _merge(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class Case:
    """A refusal: `config` patches BASE (a str is the whole file), `setup` prepares the folder
    further, `culprit` must be named by the error line."""

    id: str
    culprit: str
    config: dict | str | None = None
    args: tuple[str, ...] = TRAIN
    setup: Callable[[Path], None] | None = None
    resume: bool = False  # the case folder holds a copy of the finished run, runs/done
    files: dict[str, str] = field(default_factory=dict)


def _drop_checkpoints(d: Path) -> None:
    shutil.rmtree(d / "runs" / "done" / "checkpoints")


def _truncate_last_checkpoint(d: Path) -> None:
    last = sorted((d / "runs" / "done" / "checkpoints").glob("*.pt"))[-1]
    last.write_bytes(last.read_bytes()[:1000])


def _existing_run(d: Path) -> None:
    (d / "runs" / "taken").mkdir(parents=True)
    (d / "runs" / "taken" / "notes.md").write_text("someone's run\n")


GLOB_LIST = ("name: globs\nrules:\n  - match: {name: ['*.self_attn.q_proj.weight', "
             "'*.self_attn.k_porj.weight']}\n    format: mxfp8\n")  # fmt: skip
DUPLICATE = "model: builtin:tiny-moe\nout: runs\nrl:\n  steps: 2\n  lr: 1e-3\n  lr: 1e-2\n"

# fmt: off
CASES = [
    # numbers: types and ranges (`steps: 2.5` ran 3 steps; `grad_clip: 0` never moved a weight)
    Case("steps-fraction", "rl.steps", {"rl": {"steps": 2.5}}),
    Case("steps-word", "rl.steps", {"rl": {"steps": "ten"}}),
    Case("steps-bool", "rl.steps", {"rl": {"steps": True}}),
    Case("steps-zero", "rl.steps", {"rl": {"steps": 0}}),
    Case("lr-negative", "rl.lr", {"rl": {"lr": -1e-4}}),
    Case("lr-quoted", "rl.lr", "model: builtin:tiny-moe\nrl:\n  lr: '5e-4'\n"),
    Case("lr-inf", "rl.lr", {"rl": {"lr": float("inf")}}),
    Case("grad-clip-zero", "rl.grad_clip", {"rl": {"grad_clip": 0}}),
    Case("temperature-nan", "rl.temperature", {"rl": {"temperature": float("nan")}}),
    Case("temperature-zero", "rl.temperature", {"rl": {"temperature": 0}}),
    Case("betas-one", "rl.betas", {"rl": {"betas": [0.9]}}),
    Case("betas-range", "rl.betas[1]", {"rl": {"betas": [0.9, 1.0]}}),
    Case("tis-cap-zero", "rl.tis_cap", {"rl": {"tis_cap": 0}}),
    Case("eps-low-one", "rl.eps_low", {"rl": {"eps_low": 1.0}}),
    Case("eps-high-negative", "rl.eps_high", {"rl": {"eps_high": -0.1}}),
    Case("group-of-one", "rl.samples_per_prompt", {"rl": {"samples_per_prompt": 1}}),
    Case("spike-window", "rl.spike_window", {"rl": {"spike_window": 5}}),
    Case("max-new-tokens-builtin", "rl.max_new_tokens", {"rl": {"max_new_tokens": 100000000}}),
    # a micro-batch below one sequence (BOS + "20+20=" + 4 new tokens): mxrl.rl.memory's check
    Case("micro-batch", "rl.max_tokens_per_micro_batch", {"rl": {"max_tokens_per_micro_batch": 3}}),
    # choices and keys
    Case("correction", "rl.correction", {"rl": {"correction": "ppo"}}),
    Case("spike-action", "rl.spike_action", {"rl": {"spike_action": "halt"}}),
    Case("compute-dtype", "rl.compute_dtype", {"rl": {"compute_dtype": "fp8"}}),
    Case("backend", "rl.backend", {"rl": {"backend": "cuda"}}),
    Case("dtype", "dtype", {"dtype": "float16"}),
    Case("unknown-key", "rl.stepz", {"rl": {"stepz": 3}}),
    Case("section-not-mapping", "data", {"data": ["builtin:arithmetic"]}),
    Case("placement-mode", "placement.mode", {"placement": {"mode": "everywhere"}}),
    Case("duplicate-key", "duplicate key 'lr'", DUPLICATE),
    Case("strict-not-bool", "strict", {"strict": "yes"}),
    Case("no-model", "model", {"model": None}),
    # the environment: devices, files, folders
    Case("cuda-without-cuda", "rl.device", {"rl": {"device": "cuda"}}),
    Case("out-under-a-file", "out", {"out": "afile/runs"}),
    Case("out-unwritable", "out", {"out": "/proc/mxrl-runs"}),
    Case("run-id-taken", "run_id", {"run_id": "taken"}, setup=_existing_run),
    Case("model-missing", "model", {"model": "no-such-model"}),
    Case("config-missing", "nothing.yaml", args=("train", "--config", "nothing.yaml")),
    # recipes: strict plans check every glob of a list; recipe YAML refuses duplicate keys too
    Case("glob-list-typo", "k_porj", {"rl": {"recipe": "globs.yaml"}},
         files={"globs.yaml": GLOB_LIST}),
    Case("recipe-duplicate-key", "duplicate key 'default'", {},
         files={"recipe.yaml": RECIPE + "default: mxfp8\n"}),
    # resumes of a finished run: refused, the run byte for byte as it was
    Case("resume-recipe", "rl.recipe", {**RESUME, "rl": {"recipe": "bf16"}}, resume=True),
    Case("resume-seed", "rl.seed", {**RESUME, "rl": {"seed": 1}}, resume=True),
    Case("resume-group", "rl.samples_per_prompt", {**RESUME, "rl": {"samples_per_prompt": 4}},
         resume=True),
    Case("resume-data", "data.warmup_steps", {**RESUME, "data": {"warmup_steps": 6}},
         resume=True),
    Case("resume-plan", "plan", RESUME, resume=True, files={"recipe.yaml": OTHER_RECIPE}),
    Case("resume-no-checkpoint", "no checkpoint", RESUME, resume=True, setup=_drop_checkpoints),
    Case("resume-corrupt-checkpoint", "does not load", RESUME, resume=True,
         setup=_truncate_last_checkpoint),
    Case("resume-steps-below", "rl.steps", {**RESUME, "rl": {"steps": 1}}, resume=True),
    Case("resume-placement", "placement", {**RESUME, "placement": {"mode": "colocated"}},
         resume=True),
    Case("resume-run-id", "run_id", {**RESUME, "run_id": "other"}, resume=True),
    Case("resume-not-a-run", "resume", {"resume": "afolder"}),
    # other commands
    Case("convert-out-under-a-file", "--out",
         args=("convert", "--recipe", "bf16", "--model", "hf", "--out", "afile/x")),
    Case("convert-out-not-empty", "--overwrite",
         args=("convert", "--recipe", "bf16", "--model", "hf", "--out", "afolder"),
         setup=lambda d: (d / "afolder" / "mine.txt").write_text("mine\n")),
    Case("demo-plan-out-under-a-file", "--out", args=("demo", "--plan-only", "--out", "afile/x")),
    Case("recipe-show-typo", "'fromat'", args=("recipe", "show", "bad.yaml"),
         files={"bad.yaml": "name: bad\nrules:\n  - match: {kind: router}\n    fromat: bf16\n"}),
    Case("runs-show-unknown", "no run 'nosuch'", args=("runs", "show", "nosuch")),
]
# fmt: on


@contextlib.contextmanager
def _one_thread():
    """Tiny tensors: a second intra-op thread only waits for the core another process holds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run of the built-in model (checkpoints at steps 1 and 2), made once,
    in-process; its folder is `runs/done` under the returned folder."""
    home = tmp_path_factory.mktemp("finished")
    (home / "recipe.yaml").write_text(RECIPE)
    (home / "train.yaml").write_text(yaml.safe_dump({**BASE, "run_id": "done"}))
    with pytest.MonkeyPatch.context() as mp, _one_thread():
        mp.chdir(home)
        mp.setenv("MXRL_CACHE", str(home / "cache"))
        assert main(["train", "--config", "train.yaml"]) == 0
    assert RunRecord.open(home / "runs" / "done").events("end")[-1]["status"] == "finished"
    return home


def _prepare(case: Case, root: Path, finished: Path) -> Path:
    d = root / case.id
    d.mkdir()
    (d / "recipe.yaml").write_text(RECIPE)
    (d / "afile").write_text("a file, not a folder\n")
    (d / "afolder").mkdir()
    if case.resume:
        shutil.copytree(finished / "runs" / "done", d / "runs" / "done")
    if "convert" in case.args:
        save_pretrained(build_model(builtin_config("tiny-moe"), seed=0), d / "hf", progress=False)
    for name, text in case.files.items():
        (d / name).write_text(text)
    if isinstance(case.config, str):
        (d / "train.yaml").write_text(case.config)
    elif case.config is not None:
        config = _merge(BASE, case.config)
        config = {k: v for k, v in config.items() if v is not None}
        (d / "train.yaml").write_text(yaml.safe_dump(config))
    if case.setup is not None:
        case.setup(d)
    return d


@pytest.fixture(scope="module")
def refused(tmp_path_factory, finished) -> dict[str, tuple[Result, dict, dict]]:
    """Every case run at once (child processes): (result, snapshot before, snapshot after)."""
    root = tmp_path_factory.mktemp("faults")
    dirs = {case.id: _prepare(case, root, finished) for case in CASES}
    before = {case.id: snapshot(dirs[case.id]) for case in CASES}

    def one(case: Case) -> Result:
        env = {"MXRL_CACHE": str(dirs[case.id] / "cache")}
        return run_mxrl(case.args, cwd=dirs[case.id], env=env, timeout=240)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = dict(zip([c.id for c in CASES], pool.map(one, CASES), strict=True))
    return {cid: (results[cid], before[cid], snapshot(dirs[cid])) for cid in results}


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 28 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_before_anything_is_written(case, refused):
    result, before, after = refused[case.id]
    assert_refused(result, case.culprit, before, after)


def test_lr_in_scientific_notation_is_a_float():
    """YAML 1.1 reads `5e-4` as a string (it was a TypeError after the warm-up); the schema's
    loader reads it as YAML 1.2 and JSON do."""
    assert yaml.safe_load("lr: 5e-4") == {"lr": "5e-4"}  # what PyYAML alone does
    cfg = TrainConfig.from_dict(load_yaml("model: builtin:tiny-moe\nrl:\n  lr: 5e-4\n"))
    assert cfg.rl.lr == 0.0005 and type(cfg.rl.lr) is float


def test_a_resume_applies_a_changed_lr_and_records_it(tmp_path, finished, caplog):
    """Resumed with lr 1e-2 (the run trained at 1e-3) and one more step: the optimizer steps
    with 1e-2 (its state in the new checkpoint says so), `config_change` events hold the old and
    new values from step 3 on, config.yaml shows what the run uses now, and the lines of the
    steps before the resume point are byte for byte what they were."""
    shutil.copytree(finished / "runs", tmp_path / "runs")
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    run = tmp_path / "runs" / "done"
    lines_before = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines_before) == 2
    config = _merge(BASE, {**RESUME, "rl": {"lr": 1e-2, "steps": 3}})
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    with (
        pytest.MonkeyPatch.context() as mp,
        _one_thread(),
        caplog.at_level("INFO", logger="mxrl.rl"),
    ):
        mp.chdir(tmp_path)
        mp.setenv("MXRL_CACHE", str(finished / "cache"))
        assert main(["train", "--config", "train.yaml"]) == 0

    step3 = torch.load(run / "checkpoints" / "step_000003.pt", weights_only=False)
    assert [g["lr"] for g in step3["opt"]["param_groups"]] == [1e-2]
    step2 = torch.load(run / "checkpoints" / "step_000002.pt", weights_only=False)
    assert [g["lr"] for g in step2["opt"]["param_groups"]] == [1e-3]  # written before: as was
    record = RunRecord.open(run)
    changes = {e["field"]: (e["step"], e["old"], e["new"]) for e in record.events("config_change")}
    assert changes == {"rl.lr": (3, 1e-3, 1e-2), "rl.steps": (3, 2, 3)}
    (resume,) = record.events("resume")
    assert resume["step"] == 2 and resume["checkpoint"].endswith("step_000002.pt")
    assert resume["previous_end"]["status"] == "finished"  # the first process's end, kept
    shown = yaml.safe_load((run / "config.yaml").read_text())
    assert shown["rl"]["lr"] == 1e-2 and shown["rl"]["steps"] == 3
    lines_after = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    assert lines_after[:2] == lines_before and len(lines_after) == 3
    (end,) = record.events("end")
    assert end["status"] == "finished" and end["step"] == 3
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 3/3")]
    assert len(progress) == 1 and "reward" in progress[0] and "ETA 0s" in progress[0]


def test_config_yaml_of_a_new_run_is_the_whole_effective_config(finished):
    """Every setting, defaults included, and it reads back as the config the run was given."""
    shown = load_yaml((finished / "runs" / "done" / "config.yaml").read_text())
    assert list(shown) == [f.name for f in fields(TrainConfig)]
    assert list(shown["rl"]) == [f.name for f in fields(GRPOConfig)]
    assert TrainConfig.from_dict(shown) == TrainConfig.from_dict({**BASE, "run_id": "done"})
