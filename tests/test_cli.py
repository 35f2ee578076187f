"""The `mxrl` command: recipe list/show, demo, version, and user errors (exit code 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mxrl import __version__
from mxrl.cli import main
from mxrl.recipe import Plan, list_presets
from tests.arch.hf_configs import QWEN3_30B_A3B


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def qwen3_30b_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-30b-a3b")
    (path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return path


def _lines(out, *needles):
    return [ln for ln in out.splitlines() if all(n in ln for n in needles)]


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"mxrl {__version__}"


def test_recipe_list(capsys):
    code, out, _ = run(capsys, "recipe", "list")
    assert code == 0
    for name in list_presets():
        assert _lines(out, name)
    assert _lines(out, "mxfp8 ", "quantized", "MXFP8 end to end")
    assert _lines(out, "nvfp4-dequantized", "dequantized")
    assert _lines(out, "fp8-block ", "high_precision")
    assert _lines(out, "fp8-block-quantized", "quantized", "block FP8 end to end")


def test_recipe_show_on_qwen3_30b_a3b(capsys, qwen3_30b_dir):
    code, out, err = run(
        capsys, "recipe", "show", "nvfp4-dequantized", "--model", str(qwen3_30b_dir),
        "--expert-layout", "per_expert",
    )  # fmt: skip
    assert code == 0, err
    assert _lines(out, "model.layers.0.mlp.experts", "nvfp4")
    assert len(_lines(out, "model.layers.0.mlp.experts.*.", "[x128]", "nvfp4")) == 3
    experts_47 = _lines(out, "model.layers.47.mlp.experts")
    assert len(experts_47) == 3 and all(" bf16 " in ln for ln in experts_47)
    q_proj = _lines(out, "self_attn.q_proj")
    assert len(q_proj) == 48 and all(" bf16 " in ln for ln in q_proj)
    hash_line = _lines(out, "plan hash:")
    # pinned (tests/recipe/test_plan_hash.py): the hash README.md and docs/recipes.md print
    assert len(hash_line) == 1
    assert hash_line[0].split()[-1] == (
        "797eb5112838b97661225f151cd0224ffb82893b81b297dee6758af524c0784d"
    )
    assert "18867 tensors" in out


def test_recipe_show_fused_layout_and_json(capsys, qwen3_30b_dir):
    code, out, _ = run(
        capsys,
        "recipe",
        "show",
        "mxfp8",
        "--model",
        str(qwen3_30b_dir / "config.json"),
        "--expert-layout",
        "fused",
    )
    assert code == 0
    assert _lines(out, "model.layers.0.mlp.experts.gate_up_proj", "mxfp8")
    assert _lines(out, "model.layers.0.self_attn.q_proj.weight", "mxfp8")
    code, out, _ = run(capsys, "recipe", "show", "nvfp4-hp", "--json")
    assert code == 0
    plan = Plan.from_json(out)
    assert plan.recipe_name == "nvfp4-hp" and plan.num_layers == 4


def test_recipe_show_defaults_to_the_tiny_model(capsys, tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("name: mine\nrules:\n  - match: {kind: attention}\n    format: mxfp8\n")
    code, out, _ = run(capsys, "recipe", "show", str(recipe))
    assert code == 0
    assert "built-in tiny-moe" in out
    assert _lines(out, "model.layers.3.self_attn.q_proj.weight", "mxfp8", "rules[0]")


def test_recipe_show_warns_about_a_rule_that_matches_nothing(capsys, tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(
        "name: typo\nrules:\n  - match: {name: '*.mlp.expertz.*'}\n    format: nvfp4\n"
    )
    code, out, err = run(capsys, "recipe", "show", str(recipe))
    assert code == 0  # show is the audit: it prints the plan, and says what is wrong first
    assert "mxrl: warning: rules[0] {name: *.mlp.expertz.*} -> nvfp4 matches no tensor" in err
    assert "quantizes nothing here" in err
    assert "WARNING: 2 problem(s)" in out and "convert and train refuse it" in out


def test_demo_plan_only(capsys):
    """`mxrl demo --plan-only` prints the demo's NVFP4 plan of the tiny model (the full demo is
    exercised, shrunk, in tests/app/test_train_and_demo.py)."""
    code, out, _ = run(capsys, "demo", "--plan-only")
    assert code == 0
    assert "nvfp4-dequantized" in out
    assert _lines(out, "model.layers.0.mlp.experts.gate_up_proj", "nvfp4")
    assert "plan hash:" in out and "wrote" not in out


def test_demo_refuses_bad_seeds(capsys):
    code, _, err = run(capsys, "demo", "--seeds", "0")
    assert code == 2 and "--seeds" in err


def test_demo_refuses_bad_workers(capsys):
    code, _, err = run(capsys, "demo", "--workers", "0")
    assert code == 2 and "--workers" in err


def test_demo_refuses_an_unwritable_out_before_any_work(capsys, tmp_path):
    code, _, err = run(capsys, "demo", "--out", "/dev/null/x")
    assert code == 2
    assert err.startswith("mxrl: error: --out: '/dev/null/x' lies under '/dev/null', a file")
    assert "Traceback" not in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run(capsys, "demo", "--out", str(blocker / "sub"))
    assert code == 2 and "a file, not a folder" in err
    code, _, err = run(capsys, "demo", "--out", "/proc/mxrl-demo")  # no folder can be made there
    assert code == 2 and "'/proc/mxrl-demo' cannot be written" in err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("name: bad\nrules:\n  - match: {kind: router}\n    fromat: bf16\n", "'fromat'"),
        ("name: bad\nrules:\n  - match: {kind: routers}\n    format: bf16\n", "'routers'"),
        ("name: bad\nrules: [\n", "not valid YAML"),
        ("name: bad\nbackward: quantized\nrules:\n  - format: nvfp4\n", "quantized"),
    ],
)
def test_malformed_recipe_file_exits_2(capsys, tmp_path, content, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    code, out, err = run(capsys, "recipe", "show", str(path))
    assert code == 2
    assert needle in err and err.startswith("mxrl: error:")
    assert "Traceback" not in err and out == ""


def test_other_user_errors_exit_2(capsys, tmp_path):
    code, _, err = run(capsys, "recipe", "show", "no-such-preset")
    assert code == 2 and "no such preset or file" in err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, _, err = run(capsys, "recipe", "show", "mxfp8", "--model", str(tmp_path))
    assert code == 2 and "'llama'" in err
    code, _, err = run(capsys, "recipe", "show", "fp8-block")  # tiny model: K = 64 < 128
    assert code == 2 and "fp8_block" in err
    code, _, _ = run(capsys, "recipe", "frobnicate")
    assert code == 2
    code, _, _ = run(capsys)
    assert code == 2


def test_console_entry_point_has_no_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nrules:\n  - format: nvfp4\n    activations: sometimes\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mxrl.cli", "recipe", "show", str(path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "rules[0]" in proc.stderr and "activations" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_demo_plan_only_writes_plan_json_and_audit_txt(capsys, tmp_path):
    out_dir = tmp_path / "plan"
    code, out, _ = run(capsys, "demo", "--plan-only", "--out", str(out_dir))
    assert code == 0
    plan = Plan.from_json((out_dir / "plan.json").read_text())
    assert plan.recipe_name == "nvfp4-dequantized"
    audit = (out_dir / "audit.txt").read_text()
    assert audit.endswith(f"plan hash: {plan.hash()}\n") and audit in out
    assert sorted(p.name for p in out_dir.iterdir()) == ["audit.txt", "plan.json"]


def test_recipe_show_convert_and_train_agree_on_the_plan_hash(capsys, tmp_path, monkeypatch):
    """`recipe show` without --model resolves the built-in model under the expert layout its
    parameters have, so its hash is the one `convert` writes for that model's checkpoint and
    `train` records for a run of it."""
    import torch
    import yaml

    from mxrl.arch import builtin_config
    from mxrl.models import build_model, save_pretrained

    recipe = "nvfp4-dequantized"
    code, out, _ = run(capsys, "recipe", "show", recipe)
    assert code == 0
    (shown,) = [ln.split()[-1] for ln in _lines(out, "plan hash:")]

    hf = save_pretrained(build_model(builtin_config("tiny-moe"), seed=0), tmp_path / "hf",
                         progress=False)  # fmt: skip
    code, _, err = run(capsys, "convert", "--recipe", recipe, "--model", str(hf), "--out",
                       str(tmp_path / "q"))  # fmt: skip
    assert code == 0, err
    converted = json.loads((tmp_path / "q" / "manifest.json").read_text())["plan_hash"]

    config = {"model": "builtin:tiny-moe", "data": {"warmup_steps": 1},
              "out": str(tmp_path / "runs"), "run_id": "t",
              "rl": {"recipe": recipe, "steps": 1, "prompts_per_step": 2,
                     "samples_per_prompt": 2, "max_new_tokens": 2, "engine_tile": 16}}  # fmt: skip
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("MXRL_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code, _, err = run(capsys, "train", "--config", str(tmp_path / "train.yaml"))
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    trained = json.loads((tmp_path / "runs" / "t" / "plan.json").read_text())["hash"]
    assert shown == converted == trained
