"""Faults tier: bad input files and run folders, through the real `mxrl` command.

Each case is refused by the contract of tests/faults/harness.py: exit 2, one `mxrl: error:`
line naming the culprit (the file, the run, the path), no traceback, no existing file changed,
nothing created. Datasets go through `mxrl train` with a tiny HF checkpoint (a 64-token
vocabulary and a word-level tokenizer.json), so the dataset is read the way a user's is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from mxrl.models import build_model, save_pretrained
from tests.faults.harness import assert_refused, run_mxrl, snapshot
from tests.models.configs import CONFIGS
from tests.runs.synthetic import write_run


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny qwen3 checkpoint with a tokenizer.json (built once for the module)."""
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path_factory.mktemp("hf") / "tiny-qwen3"
    save_pretrained(build_model(CONFIGS["qwen3-tied"], seed=0), path, progress=False)
    words = ["<unk>", "<eos>", *"0123456789+-=?", "what", "is"]
    vocab = {w: i for i, w in enumerate(words)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.save(str(path / "tokenizer.json"))
    return path


def _train_config(tmp_path, model, dataset) -> str:
    cfg = {
        "model": str(model),
        "data": {"source": str(dataset), "reward": "integer"},
        "out": str(tmp_path / "runs"),
        "rl": {"recipe": "bf16", "steps": 1, "prompts_per_step": 2, "samples_per_prompt": 2},
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


# (case, file name, bytes or None for a missing file, what the error line must name)
DATASETS = [
    ("no-usable-row", "bad.jsonl", b'{oops\n{"question": "1+1="}\n', "bad.jsonl: no usable rows"),
    ("wrong-suffix", "data.csv", b"prompt,label\n1+1=,2\n", "unknown dataset format '.csv'"),
    ("not-parquet", "data.parquet", b"PAR1 this is not parquet", "not a readable Parquet file"),
    # every prompt 200 tokens: none fits the model's 128 positions with rl.max_new_tokens 8
    (
        "only-overlong-prompts",
        "long.jsonl",
        (json.dumps({"prompt": " ".join(["1"] * 200), "label": "1"}) + "\n").encode(),
        re.compile(r"long\.jsonl: no usable rows.*prompt too long: 200 tokens"),
    ),
    (
        "missing-file",
        "absent.jsonl",
        None,
        re.compile(r"data\.source: .*absent\.jsonl.*no such file"),
    ),
]


@pytest.mark.parametrize("case", DATASETS, ids=[d[0] for d in DATASETS])
def test_train_refuses_a_bad_dataset(tmp_path, hf_model, case):
    _, name, content, culprit = case
    dataset = tmp_path / name
    if content is not None:
        dataset.write_bytes(content)
    cfg = _train_config(tmp_path, hf_model, dataset)
    before = snapshot(tmp_path)
    result = run_mxrl(["train", "--config", cfg], cwd=tmp_path)
    assert_refused(result, culprit, before, snapshot(tmp_path))


def test_train_refuses_max_new_tokens_that_fill_the_positions(tmp_path, hf_model):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps({"prompt": "1 + 1 =", "label": "2"}) + "\n")
    cfg = yaml.safe_load(Path(_train_config(tmp_path, hf_model, dataset)).read_text())
    cfg["rl"]["max_new_tokens"] = 128  # the checkpoint's max_position_embeddings
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg))
    before = snapshot(tmp_path)
    result = run_mxrl(["train", "--config", str(tmp_path / "train.yaml")], cwd=tmp_path)
    assert_refused(result, "rl.max_new_tokens: 128 leaves no room", before, snapshot(tmp_path))


def _runs(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "good", steps=3)
    broken = write_run(root, "broken", steps=3)
    (broken.path / "env.json").write_text('{"start_time": ')  # a killed writer, say
    return root


def test_runs_show_refuses_an_unreadable_run(tmp_path):
    root = _runs(tmp_path)
    before = snapshot(tmp_path)
    result = run_mxrl(["runs", "show", "broken", "--root", str(root)], cwd=tmp_path)
    assert_refused(result, "run broken", before, snapshot(tmp_path))
    assert "env.json is not valid JSON" in result.error_lines[0]


def test_runs_show_refuses_an_unknown_id(tmp_path):
    root = _runs(tmp_path)
    before = snapshot(tmp_path)
    result = run_mxrl(["runs", "show", "goood", "--root", str(root)], cwd=tmp_path)
    assert_refused(result, "no run 'goood'", before, snapshot(tmp_path))
    assert "nearby: good" in result.error_lines[0]


def test_runs_list_goes_on_past_an_unreadable_run(tmp_path):
    """Not a refusal: the listing exits 0 and names the broken run below the table."""
    root = _runs(tmp_path)
    before = snapshot(tmp_path)
    result = run_mxrl(["runs", "list", "--root", str(root)], cwd=tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    rows = {ln.split()[0]: ln.split()[4] for ln in result.stdout.splitlines()[1:3]}
    assert rows == {"good": "finished", "broken": "unreadable"}
    assert "broken: env.json is not valid JSON" in result.stdout
    assert snapshot(tmp_path) == before


def test_runs_compare_out_into_a_file_path(tmp_path):
    root = _runs(tmp_path)
    report = tmp_path / "report.md"
    report.write_text("# not a folder\n")
    before = snapshot(tmp_path)
    result = run_mxrl(
        ["runs", "compare", "good", "--out", str(report), "--root", str(root)], cwd=tmp_path
    )
    assert_refused(result, str(report), before, snapshot(tmp_path))


def test_runs_compare_of_unreadable_runs_only(tmp_path):
    root = _runs(tmp_path)
    out = tmp_path / "cmp"
    before = snapshot(tmp_path)
    result = run_mxrl(
        ["runs", "compare", "broken", "--out", str(out), "--root", str(root)], cwd=tmp_path
    )
    assert_refused(result, "env.json", before, snapshot(tmp_path))
    assert not out.exists()


def test_runs_note_on_a_missing_run(tmp_path):
    root = _runs(tmp_path)
    before = snapshot(tmp_path)
    result = run_mxrl(["runs", "note", "nope", "a note", "--root", str(root)], cwd=tmp_path)
    assert_refused(result, "no run 'nope'", before, snapshot(tmp_path))


def test_runs_list_of_a_root_that_is_a_file(tmp_path):
    root = tmp_path / "runs.json"
    root.write_text(json.dumps({"runs": []}))
    before = snapshot(tmp_path)
    result = run_mxrl(["runs", "list", "--root", str(root)], cwd=tmp_path)
    assert_refused(result, "no runs folder", before, snapshot(tmp_path))
