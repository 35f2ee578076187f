"""`mxrl demo` shrunk to seconds, its held-out evaluation, the per-recipe numbers of its report."""

from __future__ import annotations

import logging
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from mxrl.app import demo as demo_mod
from mxrl.app import progress as progress_mod
from mxrl.app.demo_report import RecipeResult, band_verdict, mean_and_stderr, recipe_results
from mxrl.app.sources import TaskSource
from mxrl.app.task import ArithmeticTask
from mxrl.app.warmup import sft
from mxrl.arch import builtin_config
from mxrl.models import build_model
from mxrl.rl.trainer import GRPOTrainer
from mxrl.runs import RunRecord
from tests.rl.loop_helpers import numerics, tiny_config


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MXRL_CACHE", str(tmp_path / "cache"))


def test_demo_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_mod, "WARMUP_STEPS", 5)
    small = replace(demo_mod.demo_config("cpu"), prompts_per_step=2, samples_per_prompt=2,
                    eval_every=1)  # fmt: skip
    monkeypatch.setattr(demo_mod, "demo_config", lambda device: small)
    report = demo_mod.run_demo(
        tmp_path / "demo", recipes=("bf16", "nvfp4-dequantized"), seeds=2, steps=2, workers=1
    )
    text = report.read_text()
    assert "within BF16's band" in text
    assert (
        "GRPO: 2 prompts x 2 samples per step, AdamW lr 0.0005 (constant for the first half" in text
    )
    bf16_row = next(ln for ln in text.splitlines() if ln.startswith("| bf16 | 2 |"))
    assert bf16_row.count("—") == 1  # BF16 is not compared with itself
    nvfp4_row = next(ln for ln in text.splitlines() if ln.startswith("| nvfp4-dequantized | 2 |"))
    assert "yes (" in nvfp4_row or "no (" in nvfp4_row
    assert "yes (4/4)" in nvfp4_row  # every weight sync verified, 2 seeds x 2 steps
    for png in ("heldout.png", "reward.png", "mismatch.png", "grad_norm.png", "step_time.png"):
        assert (tmp_path / "demo" / png).stat().st_size > 1000
    runs = sorted((tmp_path / "demo" / "runs").iterdir())
    assert len(runs) == 4
    rows = RunRecord.open(runs[0]).metrics()
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1, 2]


def test_runs_in_worker_processes_give_the_same_numbers(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(demo_mod, "WARMUP_STEPS", 5)
    small = replace(demo_mod.demo_config("cpu"), prompts_per_step=2, samples_per_prompt=2,
                    eval_every=1)  # fmt: skip
    monkeypatch.setattr(demo_mod, "demo_config", lambda device: small)
    metrics = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mxrl.app.demo"):
            demo_mod.run_demo(out, recipes=("bf16", "mxfp8"), seeds=1, steps=2, workers=workers)
        # the runs' steps reach the parent's progress lines (from the workers, by a queue):
        # PROGRESS_EVERY (20) > 2 steps, so one line per run, at its last step
        lines = [r.getMessage() for r in caplog.records if "  step " in r.getMessage()]
        assert sorted(ln.split("  step ")[0] for ln in lines) == [
            "demo: bf16 seed 0",
            "demo: mxfp8 seed 0",
        ], lines
        assert all("step 2/2  reward " in ln and "held-out " in ln for ln in lines), lines
        runs = sorted((out / "runs").iterdir())
        assert [r.name.split("-seed")[0] for r in runs] == ["bf16", "mxfp8"]
        metrics[workers] = [numerics(RunRecord.open(run).metrics()) for run in runs]
    assert metrics[1] == metrics[2]


def test_demo_reports_each_runs_steps_as_they_go(tmp_path, monkeypatch, caplog):
    """A progress line per run every PROGRESS_EVERY steps and at its last: step, the mean
    reward since the previous line, the latest held-out accuracy, and the whole demo's steps."""
    monkeypatch.setattr(demo_mod, "WARMUP_STEPS", 5)
    monkeypatch.setattr(demo_mod, "PROGRESS_EVERY", 2)
    small = replace(demo_mod.demo_config("cpu"), prompts_per_step=2, samples_per_prompt=2,
                    eval_every=2)  # fmt: skip
    monkeypatch.setattr(demo_mod, "demo_config", lambda device: small)
    with caplog.at_level(logging.INFO, logger="mxrl.app.demo"):
        demo_mod.run_demo(tmp_path / "demo", recipes=("bf16",), seeds=2, steps=3, workers=1)
    lines = [r.getMessage() for r in caplog.records if "  step " in r.getMessage()]
    heads = [ln.split("  reward ")[0] for ln in lines]
    assert heads == [
        "demo: bf16 seed 0  step 2/3",
        "demo: bf16 seed 0  step 3/3",
        "demo: bf16 seed 1  step 2/3",
        "demo: bf16 seed 1  step 3/3",
    ], lines
    assert [ln.split("| ")[1].split(",")[0] for ln in lines] == [
        "all runs 2/6 steps",
        "all runs 3/6 steps",
        "all runs 5/6 steps",
        "all runs 6/6 steps",
    ]
    assert "held-out" in lines[0] and "(step 2)" in lines[0] and "(step 3)" in lines[1]
    assert "ETA" in lines[0] and "ETA" not in lines[-1]  # nothing left at the end
    runs = sorted((tmp_path / "demo" / "runs").iterdir())
    rewards = [r["reward/mean"] for r in RunRecord.open(runs[0]).metrics() if "reward/mean" in r]
    assert f"reward {sum(rewards[:2]) / 2:.2f}" in lines[0]  # the mean of steps 1-2
    assert f"reward {rewards[2]:.2f}" in lines[1]


def test_progress_eta_weighs_the_remaining_steps_by_recipe_cost(caplog):
    clock = iter([0.0, 10.0])
    p = progress_mod.Progress(
        steps={("bf16", 0): 4, ("mxfp8", 0): 4},
        cost={("bf16", 0): 1.0, ("mxfp8", 0): 2.0},
        every=2,
        clock=lambda: next(clock),
    )
    with caplog.at_level(logging.INFO, logger="mxrl.app.demo"):
        p.update("bf16", 0, 0, None, 0.25)  # the step-0 evaluation: no line, not a step
        p.update("bf16", 0, 1, 0.5, None)  # no line: not a multiple of 2
        p.update("bf16", 0, 2, 0.7, None)  # at 10 s: 2 of 12 cost units done -> 50 s left
    assert [r.getMessage() for r in caplog.records] == [
        "demo: bf16 seed 0  step 2/4  reward 0.60  held-out 0.25 (step 0)  "
        "| all runs 2/8 steps, 10s, ETA 50s"
    ]


def test_the_default_demo_runs_three_seeds_and_holds_out_what_it_never_trains_on():
    assert demo_mod.run_demo.__kwdefaults__["seeds"] == demo_mod.DEMO_SEEDS >= 3
    warm, rl = demo_mod.demo_task(-1), demo_mod.demo_task(0)
    assert warm.eval_problems() == rl.eval_problems()
    assert not {e.problem for e in warm.supervised_examples(1000)} & set(rl.eval_problems())


def test_evaluation_every_k_steps_and_at_the_end(tmp_path):
    cfg = tiny_config(recipe="bf16", steps=3, eval_every=2)
    model = build_model(builtin_config("tiny-moe"), seed=0)
    record = RunRecord.create(tmp_path, "ev", config={})
    task = ArithmeticTask(0, max_operand=20, eval_size=8)
    GRPOTrainer(cfg, model, TaskSource(task), record).run()
    evals = {r["step"]: r["eval/accuracy"] for r in record.metrics() if "eval/accuracy" in r}
    assert sorted(evals) == [0, 2, 3] and all(0.0 <= v <= 1.0 for v in evals.values())
    assert [r["step"] for r in record.metrics() if "reward/mean" in r] == [1, 2, 3]


def test_evaluation_needs_a_held_out_set(tmp_path):
    class NoEval:
        stop_token_ids = (1,)

    model = build_model(builtin_config("tiny-moe"), seed=0)
    record = RunRecord.create(tmp_path, "x", config={})
    with pytest.raises(ValueError, match="eval_every"):
        GRPOTrainer(tiny_config(eval_every=1), model, NoEval(), record)


def test_sft_leaves_no_gradients():
    model = build_model(builtin_config("tiny-moe"), seed=0)
    sft(model, ArithmeticTask(0), steps=2, batch_size=4)
    assert all(p.grad is None for p in model.parameters())


def test_the_learning_rate_holds_for_half_the_run_then_decays_to_a_fifth():
    factors = [demo_mod.lr_factor(step, 140) for step in range(1, 141)]
    assert factors[:70] == [1.0] * 70
    assert all(a > b for a, b in pairwise(factors[69:]))
    assert factors[-1] == pytest.approx(demo_mod.LR_FINAL_FRACTION) == pytest.approx(0.2)


def test_band_verdict_and_standard_error():
    mean, se = mean_and_stderr([0.5, 0.6, 0.7])
    assert mean == pytest.approx(0.6) and se == pytest.approx(0.1 / 3**0.5)
    assert mean_and_stderr([0.4]) == (0.4, 0.0)
    bf16 = RecipeResult("bf16", 3, 0.35, 0.60, 0.03, 1e-4, 0, 180, 180)
    near = replace(bf16, recipe="mxfp8", final=0.62)
    far = replace(bf16, recipe="mxfp8", final=0.50)
    assert band_verdict(bf16, bf16) == "—"
    assert band_verdict(near, bf16) == "yes (+0.020)"
    assert band_verdict(far, bf16) == "no (-0.100)"
    assert near.gain == pytest.approx(0.27)


def test_results_group_seeds_by_recipe(tmp_path):
    runs = []
    for i, (recipe, finals) in enumerate([("bf16", (0.3, 0.6)), ("bf16", (0.4, 0.7))]):
        rec = RunRecord.create(Path(tmp_path), f"r{i}", config={"recipe": recipe})
        rec.log_metrics(0, {"eval/accuracy": finals[0]})
        rec.log_metrics(1, {"mismatch/k3": 1e-4, "eval/accuracy": finals[1]})
        runs.append(rec)
    (res,) = recipe_results(runs)
    assert res.num_seeds == 2 and res.start == pytest.approx(0.35)
    assert res.final == pytest.approx(0.65) and res.final_se == pytest.approx(0.05)
    assert torch.isclose(torch.tensor(res.k3), torch.tensor(1e-4))
