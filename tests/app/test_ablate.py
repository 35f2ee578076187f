"""`mxrl ablate`: the whole pipeline on the CPU (--tiny), its refusals, the model it is sized for,
the warm-up cache and the report's verdicts."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from mxrl.app import ablate as ablate_mod
from mxrl.app import ablate_report as ablate_mod_report
from mxrl.app.ablate_report import RecipeNumbers, equivalence, mismatch_ordering, num_params
from mxrl.app.ablate_warmup import warm_start
from mxrl.app.demo_report import RecipeResult
from mxrl.arch import tensors_from_hf_config
from mxrl.cli import main
from mxrl.formats.constants import Format
from mxrl.recipe import resolve


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MXRL_CACHE", str(tmp_path / "cache"))


def test_tiny_runs_every_recipe_and_writes_the_report(tmp_path, capsys):
    out = tmp_path / "ablate"
    assert main(["ablate", "--tiny", "--seeds", "1", "--out", str(out)]) == 0
    assert f"report at {out / 'report.md'}" in capsys.readouterr().out
    text = (out / "report.md").read_text()
    for section in ("## Held-out accuracy", "## Train-rollout mismatch",
                    "## Gradient norms and spikes", "## Time per step", "## Runs", "## Figures"):  # fmt: skip
        assert section in text
    for recipe in ablate_mod.ABLATION_RECIPES:
        assert f"| {recipe} | 1 |" in text  # its accuracy row
    assert "BF16 lowest" in text and "NVFP4 starts higher than MXFP8" in text
    for png in ("heldout", "reward", "mismatch", "grad_norm", "step_time", "logp_diff"):
        assert (out / f"{png}.png").stat().st_size > 1000
        assert f"]({png}.png)" in text
    runs = sorted((out / "runs").iterdir())
    assert len(runs) == len(ablate_mod.ABLATION_RECIPES) == 7
    # the report again from the records alone (what an interrupted GPU call leaves)
    (out / "report.md").unlink()
    (out / "heldout.png").unlink()
    assert main(["ablate", "--tiny", "--report-only", "--out", str(out)]) == 0
    again = (out / "report.md").read_text()
    assert "Time: not measured" in again and (out / "heldout.png").exists()
    assert again.split("## Held-out accuracy")[1] == text.split("## Held-out accuracy")[1]
    assert main(["ablate", "--report-only", "--out", str(tmp_path / "none")]) == 2
    # without --tiny the model comes from the records: named in their config, or (records from
    # before it was) recognised by the plan's layers and embedding
    assert main(["ablate", "--report-only", "--out", str(out)]) == 0
    assert "Model `tiny-moe`" in (out / "report.md").read_text()
    for config in (out / "runs").glob("*/config.yaml"):
        lines = config.read_text().splitlines(keepends=True)
        assert "model: tiny-moe\n" in lines
        config.write_text("".join(x for x in lines if x != "model: tiny-moe\n"))
    assert main(["ablate", "--report-only", "--out", str(out)]) == 0
    assert "Model `tiny-moe`" in (out / "report.md").read_text()


def test_seeds_are_grouped_and_a_correction_is_recorded(tmp_path):
    """Two worker processes (as on the GPU): each reads the warmed weights from the cache file
    and builds its task from the pickled settings."""
    report = ablate_mod.run_ablation(
        tmp_path / "a", recipes=("bf16", "nvfp4-hp"), seeds=2, tiny=True, correction="tis",
        workers=2, lr=7e-4,
    )  # fmt: skip
    text = report.read_text()
    assert "| bf16 | 2 |" in text and "| nvfp4-hp | 2 |" in text
    assert "Rollout correction: tis" in text
    # lr= reaches every run (TINY's own is 5e-4), and a report rewritten from the records alone
    # says the runs' learning rate and held-out size, not the settings' defaults
    assert ablate_mod.TINY.lr != 7e-4 and "AdamW lr 0.0007 (" in text
    for run in (tmp_path / "a" / "runs").iterdir():
        assert "\nlr: 0.0007\n" in (run / "config.yaml").read_text()
    again = ablate_mod.rewrite_report(tmp_path / "a").read_text()
    assert "AdamW lr 0.0007 (" in again
    assert f"{ablate_mod.TINY.eval_size} held-out problems" in again
    assert ablate_mod.AblationSettings().eval_size != ablate_mod.TINY.eval_size
    # the second invocation reads the cached warm-up
    settings = ablate_mod.TINY
    task = ablate_mod.ablation_task(settings, -1)
    config = ablate_mod.model_config(settings.model)
    _, info = warm_start(config, task, settings)
    assert info["source"] == "cache" and info["steps"] == settings.warmup_max_steps


def test_refuses_without_a_gpu_before_writing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "never"
    assert main(["ablate", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mxrl: error: ablate needs a CUDA GPU (") and err.count("\n") == 1
    assert not out.exists()
    with pytest.raises(ValueError, match="CUDA GPU"):
        ablate_mod.run_ablation(out)
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--workers", "0"], "--workers must be >= 1"),
        (["--lr", "0"], "--lr must be in (0, 1)"),
        (["--lr", "nan"], "--lr must be in (0, 1)"),
        (["--lr", "3"], "--lr must be in (0, 1)"),
        (["--recipes", "bf16,nvfp5"], "unknown preset(s) ['nvfp5']"),
        (["--recipes", ","], "unknown preset"),
        (["--recipes", "bf16,mxfp8,bf16"], "names a preset twice"),
        (["--report-only"], "is not a folder of runs"),
        (["--baseline", "/nonexistent"], "holds no BF16 run"),
    ],
)
def test_bad_arguments_are_one_line_and_write_nothing(tmp_path, capsys, args, words):
    out = tmp_path / "never"
    assert main(["ablate", "--tiny", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mxrl: error: ") and words in err and err.count("\n") == 1
    assert not out.exists()


def test_the_model_is_the_issues_size_with_the_articles_bf16_exceptions():
    config = ablate_mod.model_config("ablate-moe")
    assert config["model_type"] == "qwen3_moe"
    assert num_params(config) == 113_456_640 >= 100_000_000
    assert config["num_experts"] >= 32 and config["num_experts_per_tok"] >= 4
    assert config["num_hidden_layers"] >= 8 and config["shared_expert_intermediate_size"] > 0
    tensors = tensors_from_hf_config(config)
    for recipe in ("mxfp8", "nvfp4-hp"):
        plan = resolve(recipe, tensors)
        assert not plan.problems
        for spec in plan.values():
            if spec.layer in (6, 7) or spec.layer is None:  # the last 15% (2 of 8), embed, head
                assert spec.format is Format.BF16, spec.name
            if spec.kind.value in ("router", "shared_expert"):
                assert spec.format is Format.BF16, spec.name
        quantized = {s.kind.value for s in plan.values() if s.format is not Format.BF16}
        assert "routed_expert" in quantized
        experts = {s.layer for s in plan.values() if s.kind.value == "routed_expert"
                   and s.format is not Format.BF16}  # fmt: skip
        assert experts == set(range(6))  # "last 15%" of 8 layers is 2: 6 and 7 stay bf16
    # the task's answers fit the model's positions: BOS + the longest prompt + the answer
    task = ablate_mod.ablation_task(ablate_mod.AblationSettings(), 0)
    assert 1 + len("12*12*12=") + task.max_new_tokens <= config["max_position_embeddings"]


def test_a_seventh_configuration_is_one_name():
    assert ablate_mod.ABLATION_RECIPES[0] == "bf16" and len(ablate_mod.ABLATION_RECIPES) == 7
    settings = ablate_mod.AblationSettings()
    cfg = ablate_mod.grpo_config(settings, "nvfp4-hp", 2, None)
    assert (cfg.recipe, cfg.seed, cfg.steps, cfg.device) == ("nvfp4-hp", 2, settings.steps, "cuda")
    assert cfg.prompts_per_step * cfg.samples_per_prompt == 256 and cfg.max_new_tokens == 5
    with pytest.raises(ValueError, match="samples_per_prompt"):
        replace(settings, samples_per_prompt=1)


def _result(
    recipe: str, final: float, se: float = 0.01, k3: float = 1e-4, start: float = 0.3
) -> RecipeResult:
    return RecipeResult(recipe, 3, start, final, se, k3, 0, 300, 300)


def test_equivalence_is_within_003_of_bf16_and_the_band_is_two_standard_errors():
    bf16 = _result("bf16", 0.60, se=0.01)
    assert equivalence(bf16, bf16) == ("—", "—")
    assert equivalence(_result("mxfp8", 0.62), bf16) == ("yes (+0.020)", "no")
    assert equivalence(_result("mxfp8", 0.585), bf16) == ("yes (-0.015)", "yes")
    assert equivalence(_result("nvfp4-hp", 0.56), bf16) == ("NO (-0.040)", "no")


def test_the_mismatch_ordering_names_what_breaks_it():
    def numbers(recipe, k3, early):
        return RecipeNumbers(_result(recipe, 0.6, k3=k3), early, 0, 0, 0, 0, [], {})

    holds = [numbers("bf16", 1e-5, 1e-5), numbers("mxfp8", 1e-3, 1e-3),
             numbers("nvfp4-hp", 2e-3, 5e-3)]  # fmt: skip
    lines = mismatch_ordering(holds)
    assert lines[0].startswith("k3 over the run, smallest first: bf16 1.00e-05 < mxfp8")
    assert lines[1].endswith(": yes") and "NVFP4 starts higher than MXFP8" in lines[2]
    assert ": yes (" in lines[2]
    broken = [numbers("bf16", 5e-3, 1e-5), numbers("mxfp8", 1e-3, 6e-3),
              numbers("nvfp4-hp", 2e-3, 5e-3)]  # fmt: skip
    lines = mismatch_ordering(broken)
    assert lines[1].endswith(": NO") and ": NO (" in lines[2]


def test_the_worst_is_the_lowest_and_a_short_bf16_is_said(tmp_path):
    """TIS / MIS go to the recipe that ends lowest (not to one that ends above BF16's band,
    which fails the equivalence too); when BF16 itself gains less than the bar, the verdict
    says the settings, not a format, fall short."""
    from mxrl.app.ablate_report import _verdict

    def numbers(recipe, start, final):
        return RecipeNumbers(_result(recipe, final, start=start), 0, 0, 0, 0, 0, [], {})

    bf16 = numbers("bf16", 0.30, 0.37)
    failing = [bf16, numbers("nvfp4-hp", 0.30, 0.41), numbers("mxfp8-hp", 0.30, 0.355)]
    text = "\n".join(_verdict(failing, bf16.result, tmp_path / "a"))
    assert "The worst is mxfp8-hp;" in text
    assert f"--recipes mxfp8-hp --correction tis --baseline {tmp_path / 'a'}" in text
    assert "BF16 itself gains less than 0.15" in text
    learning = numbers("bf16", 0.20, 0.40)
    text = "\n".join(_verdict([numbers("mxfp8", 0.2, 0.3)], learning.result, tmp_path))
    assert "The worst is mxfp8;" in text and "BF16 itself" not in text


def test_warm_up_settings_key_the_cache(tmp_path):
    settings = ablate_mod.TINY
    task = ablate_mod.ablation_task(settings, -1)
    config = ablate_mod.model_config(settings.model)
    path, info = warm_start(config, task, settings)
    assert info["source"] == "trained" and path.exists()
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["steps"] == len(meta["checks"]) * settings.warmup_check_every
    other, info2 = warm_start(config, task, replace(settings, warmup_lr=1e-3))
    assert other != path and info2["source"] == "trained"


def test_an_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["ablate", "--tiny", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mxrl: error: --out") and "a file, not a folder" in err
    assert err.count("\n") == 1


def test_a_rerun_with_tis_takes_bf16_from_an_earlier_ablation(tmp_path, capsys):
    first, rerun = tmp_path / "first", tmp_path / "rerun"
    ablate_mod.run_ablation(first, recipes=("bf16",), seeds=1, tiny=True)
    args = ["ablate", "--tiny", "--seeds", "1", "--recipes", "mxfp8", "--correction", "tis"]
    assert main([*args, "--baseline", str(first), "--out", str(rerun)]) == 0
    text = (rerun / "report.md").read_text()
    assert "| bf16 | 1 |" in text and "| mxfp8 | 1 |" in text
    assert "Rollout correction: tis" in text and "BF16 baseline: 1 run(s) of an earlier" in text
    assert len(list((rerun / "runs").iterdir())) == 1  # BF16 was not trained again
    capsys.readouterr()
    assert main([*args, "--baseline", str(rerun / "runs"), "--out", str(tmp_path / "x")]) == 2
    assert "holds no BF16 run" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_as_many_runs_at_once_as_the_gpu_memory_holds():
    # the ablation's model: 113,456,640 parameters x 24 bytes = 2,722,959,360, + a 128 MiB KV
    # cache (134,217,728) + 1.75 GiB (1,879,048,192) = 4,736,225,280 bytes per run
    params = 113_456_640
    per_run = 4_736_225_280
    kv = ablate_mod.AblationSettings().kv_cache_bytes
    assert kv == 128 << 20
    assert ablate_mod.runs_that_fit(18 * per_run - 1, params, kv) == 17
    assert ablate_mod.runs_that_fit(18 * per_run, params, kv) == 18
    # an 80 GB H100 with its 77.5 GiB free holds 17, not the 21 runs; an H200's 139 GiB all
    assert ablate_mod.runs_that_fit(int(77.5 * 2**30), params, kv) == 17
    assert ablate_mod.runs_that_fit(139 * 2**30, params, kv) >= 21
    assert ablate_mod.runs_that_fit(0, params, kv) == 1  # one at a time, never none


def test_runs_at_once_is_the_mean_overlap_of_the_runs_spans():
    class Run:
        def __init__(self, run_id, span):
            self.run_id, self._span = run_id, span

        def span(self):
            return self._span

    runs = [Run("a", (0.0, 10.0)), Run("b", (0.0, 10.0)), Run("c", (5.0, 15.0)),
            Run("later", (20.0, 30.0)), Run("none", None), Run("one-event", (3.0, 3.0))]  # fmt: skip
    load = ablate_mod_report.runs_at_once(runs)
    # a: itself 10 + b 10 + c 5 (5..10) over its 10 s = 2.5; c: a 5 + b 5 + itself 10 = 2.0;
    # later overlaps nobody (1.0); no span, or a zero-length one: NaN
    assert load["a"] == load["b"] == 2.5
    assert load["c"] == 2.0
    assert load["later"] == 1.0
    assert math.isnan(load["none"]) and math.isnan(load["one-event"])
    assert list(load) == ["a", "b", "c", "later", "none", "one-event"]
