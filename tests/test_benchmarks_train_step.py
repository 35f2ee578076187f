"""benchmarks/train_step.py end to end on the CPU, shrunk (--tiny): the DeepSeek-V3 slice
(`--family deepseek-v3`) against transformers' DeepseekV3ForCausalLM on the same weights, in a
section of its own (the Qwen `train_step` section kept)."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_deepseek_tiny_cpu_run_writes_hf_and_mxrl_rows(tmp_path, monkeypatch):
    train_step = load_benchmark("train_step", monkeypatch)
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"train_step": {"kept": True}}))
    args = ["--family", "deepseek-v3", "--tiny", "--device", "cpu", "--layers", "2",
            "--shapes", "2x8", "--presets", "bf16", "fp8-block", "--warmup", "1",
            "--repeats", "1", "--out", str(out)]  # fmt: skip
    assert train_step.main(args) == 0

    data = json.loads(out.read_text())
    assert data["train_step"] == {"kept": True}
    section = data["train_step_deepseek_v3"]
    model = section["model"]
    assert model["family"] == "deepseek-v3" and model["layers"] == 2
    assert 0 < model["active_params_per_token"] < model["num_params"]
    rows = {r["preset"]: r for r in section["rows"]}
    assert set(rows) == {"hf fp32+autocast", "hf bf16", "bf16", "fp8-block"}
    for r in rows.values():
        assert r["s_step"] > 0 and r["tflops"] > 0 and (r["B"], r["S"]) == (2, 8)
    assert rows["hf bf16"]["experts_implementation"] in ("grouped_mm", "eager")
    assert rows["hf bf16"]["transformers"]
    assert rows["bf16"]["bf16_x_hf_bf16"] > 0 and rows["fp8-block"]["s_step_fresh"] > 0
    hf_s = rows["hf bf16"]["s_step"]
    for r in rows.values():  # each row's time over HF's bf16 step, its own row 1
        assert r["x_hf_bf16"] == r["s_step"] / hf_s
    assert rows["hf bf16"]["x_hf_bf16"] == 1.0
    assert rows["bf16"]["x_hf_bf16"] == rows["bf16"]["bf16_x_hf_bf16"]


def test_micro_batches_and_bf16_weights_reach_the_rows_and_the_model(tmp_path, monkeypatch):
    """`--micro-batches 3`: make_step asked for three forwards and backwards per step, tokens x3;
    `--bf16-weights cast|held` sets the experts' option and is written in the section."""
    train_step = load_benchmark("train_step", monkeypatch)
    seen = []
    build = train_step.make_step

    def counting(model, *a, **kw):
        seen.append((kw.get("micro_batches"), {m.hold_bf16 for m in _experts(model)}))
        return build(model, *a, **kw)

    monkeypatch.setattr(train_step, "make_step", counting)
    for how in ("cast", "held"):
        out = tmp_path / f"{how}.json"
        args = ["--tiny", "--device", "cpu", "--layers", "1", "--shapes", "2x8", "--presets",
                "bf16", "--skip-hf", "--warmup", "0", "--repeats", "1", "--micro-batches", "3",
                "--bf16-weights", how, "--optimizer", "--out", str(out)]  # fmt: skip
        assert train_step.main(args) == 0
        section = json.loads(out.read_text())["train_step"]
        assert (section["bf16_weights"], section["micro_batches"]) == (how, 3)
        (row,) = section["rows"]
        assert (row["tokens"], row["micro_batches"]) == (3 * 2 * 8, 3)
    assert seen == [(3, {False}), (3, {True})]


def _experts(model):
    from mxrl.nn import GroupedExperts

    return [m for m in model.modules() if isinstance(m, GroupedExperts)]
