"""The fp8-block recipe against an FP8 checkpoint's own bytes: the exact condition under which
re-quantizing the dequantized master gives them back, the report's counts against an
independent count, `mxrl convert` end to end, and the engine on an FP8 checkpoint."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mxrl.app.train import _record_fp8_source, fp8_source_report
from mxrl.arch.experts import target_of
from mxrl.cli import main
from mxrl.engine import Engine, SamplingParams
from mxrl.formats import QTensor
from mxrl.formats.constants import Format
from mxrl.models import from_pretrained, hf_fp8
from mxrl.recipe import TensorSpec, resolve
from mxrl.runs import RunRecord
from mxrl.weights import export_weights, read_quantized_checkpoint
from mxrl.weights.export import quantize_tensor
from mxrl.weights.fp8_source import REASONS, compare_with_source, reasons_of
from tests.models.fp8_checkpoints import FULL, ROWS, write_fp8_checkpoint

CASES = {
    "full-float": (FULL, "float"),
    "rows-float": (ROWS, "float"),  # k/v_proj [192, 256]: a partial row block
    "full-ue8m0": (FULL, "ue8m0"),
}
E4M3_CODES = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8src")
    return {
        name: write_fp8_checkpoint(root / name, cfg, scale_fmt=fmt, seed=3)
        for name, (cfg, fmt) in CASES.items()
    }


def _predicted(q: torch.Tensor, s: torch.Tensor) -> np.ndarray:
    """The condition, in numpy float32 (independent of the code): per block
    fl(max(fl(M * s), 1e-4) / 448) == s bit for bit, M the block's largest |E4M3 value|."""
    v = np.abs(q.to(torch.float32).numpy())
    nr, nk = s.shape
    out = np.zeros((nr, nk), dtype=bool)
    sf = s.to(torch.float32).numpy()
    for i in range(nr):
        for j in range(nk):
            m = np.float32(v[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].max())
            amax = np.maximum(np.float32(m * sf[i, j]), np.float32(1e-4))
            back = np.float32(amax / np.float32(448.0))
            out[i, j] = back.view(np.int32) == sf[i, j].view(np.int32)
    return out


def _block_equal(q, s, codes, scales) -> np.ndarray:
    """Per block: the file's codes and scale bits are mxrl's (a plain loop)."""
    qb, cb = q.view(torch.uint8).numpy(), codes.numpy()
    sb, mb = s.to(torch.float32).numpy().view(np.int32), scales.numpy().view(np.int32)
    nr, nk = s.shape
    out = np.zeros((nr, nk), dtype=bool)
    for i in range(nr):
        for j in range(nk):
            blk = np.s_[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            out[i, j] = sb[i, j] == mb[i, j] and (qb[blk] == cb[blk]).all()
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_condition_is_exact_on_every_kind_of_block(device):
    """Synthetic blocks of every E4M3 code (both zeros included) under scales of every kind
    (random fp32, powers of two, at and around the 1e-4/448 floor), with the largest code 448
    or below it, or all zero: quantizing the dequantized values with the export's quantizer
    gives the block back exactly where the condition holds, and the codes come back wherever
    the scale does. On CUDA the export's quantizer is the Triton kernel."""
    gen = torch.Generator().manual_seed(0)
    nb = 384
    q = E4M3_CODES[torch.randint(len(E4M3_CODES), (128, 128 * nb), generator=gen)]
    blocks = q.view(128, nb, 128)
    values = blocks.view(torch.float8_e4m3fn).to(torch.float32).abs()
    kind = torch.arange(nb) % 4
    for b in range(nb):
        if kind[b] == 0:  # largest |code| 448 (amax/448 scales)
            blocks[5, b, 7] = 0x7E if b % 2 else 0xFE
        elif kind[b] == 1:  # cap below 448: drop every code above a random bound
            cap = float(2.0 ** torch.randint(-6, 9, (1,), generator=gen))
            blocks[:, b][values[:, b] > cap] = 0x80
        elif kind[b] == 2 and b % 8 == 2:
            blocks[:, b] = 0  # an all-zero block
        else:
            blocks[5, b, 7] = 0x7E
    floor = np.float32(np.float32(1e-4) / np.float32(448.0))
    choice = torch.arange(nb) % 5
    s = torch.exp(torch.empty(nb).uniform_(-16, 4, generator=gen)).to(torch.float32)
    s = torch.where(choice == 1, torch.exp2(torch.round(torch.log2(s))), s)  # powers of two
    s = torch.where(choice == 2, torch.tensor(float(floor)), s)  # at the floor
    near = torch.tensor(float(floor)) * torch.empty(nb).uniform_(0.25, 2.0, generator=gen)
    s = torch.where(choice == 3, near, s).reshape(1, nb)
    w = hf_fp8.dequantize(q.view(torch.float8_e4m3fn), s)
    spec = TensorSpec(name="w", shape=tuple(w.shape), kind="attention", layer=0, expert=None,
                      role="q_proj", format=Format.FP8_BLOCK, block=(128, 128))  # fmt: skip
    mine = quantize_tensor(w.to(device), spec)
    mine = QTensor(qdata=mine.qdata.cpu(), scale=mine.scale.cpu(), fmt=mine.fmt, shape=mine.shape)
    predicted = _predicted(q.view(torch.float8_e4m3fn), s)
    equal = _block_equal(q, s, mine.qdata, mine.scale)
    assert (equal == predicted).all(), np.argwhere(equal != predicted)[:5]
    scale_back = mine.scale.view(torch.int32) == s.view(torch.int32)
    for j in np.argwhere(scale_back.numpy()[0])[:, 0]:  # codes follow the scale
        assert torch.equal(mine.qdata[:, j * 128 : (j + 1) * 128], q[:, j * 128 : (j + 1) * 128])
    assert 0.2 < predicted.mean() < 0.8  # both outcomes are exercised
    neg_zero = (q == 0x80) & (mine.qdata == 0x80)
    assert neg_zero.any()  # -0 comes back as -0 (0x80), not +0
    assert ((reasons_of(q.view(torch.float8_e4m3fn), s) < 0).numpy() == predicted).all()


def test_about_89_percent_of_fp32_significands_survive_448():
    """fl(fl(448 s) / 448) == s for 7,489,829 of the 2^23 significands (89.3%, the docs'
    figure), the same at every exponent."""
    bits = torch.arange(2**23, dtype=torch.int32)
    for exponent in (127, 127 - 20, 127 + 10):
        s = (bits | (exponent << 23)).view(torch.float32)
        back = (s * 448.0) / 448.0
        assert int((back.view(torch.int32) == s.view(torch.int32)).sum()) == 7_489_829


@pytest.mark.parametrize("case", CASES)
def test_report_counts_blocks_as_an_independent_count(checkpoints, case):
    """(b) the report's counts equal a count of the engine's export bytes against the file's,
    and the condition predicts each block: where it holds the bytes are the file's."""
    path = checkpoints[case]
    model = from_pretrained(path)
    plan = resolve("fp8-block", {n: p.shape for n, p in model.named_parameters()})
    report = compare_with_source(path, plan, model)
    records = {r.name: r.value for r in export_weights(model.named_parameters(), plan)}
    tensors = load_file(path / "model.safetensors")
    count = dict(tensors=0, tensors_equal=0, blocks=0, blocks_equal=0, code_bytes=0,
                 code_bytes_equal=0, not_compared=0, below_448=0)  # fmt: skip
    for key, q in tensors.items():
        if q.dtype != torch.float8_e4m3fn:
            continue
        target = target_of(key)
        if plan[target.param].format is not Format.FP8_BLOCK:
            count["not_compared"] += 1
            continue
        s = tensors[hf_fp8.scale_key(key)].to(torch.float32)
        value = records[target.param]
        codes, scales = target.view(value.qdata), target.view(value.scale)
        equal, predicted = _block_equal(q, s, codes, scales), _predicted(q, s)
        assert (equal == predicted).all(), key
        count["tensors"] += 1
        count["tensors_equal"] += bool(equal.all())
        count["blocks"] += equal.size
        count["blocks_equal"] += int(equal.sum())
        count["code_bytes"] += q.numel()
        count["code_bytes_equal"] += int((q.view(torch.uint8) == codes).sum())
        m = hf_fp8.dequantize(q, torch.ones_like(s)).abs()
        for i, j in np.argwhere(~equal):
            count["below_448"] += bool(
                m[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].max() < 448
            )
    assert report is not None
    got = report.fields()
    assert {k: got[k] for k in count if k in got} == {k: v for k, v in count.items() if k in got}
    assert count["tensors"] > 0 and count["not_compared"] > 0  # the last layer stays bf16
    differing = report.blocks - report.blocks_equal
    assert sum(report.reasons.values()) == differing
    if case == "full-ue8m0":
        assert differing > 0 and report.reasons.get("pow2", 0) == count["below_448"] > 0
        assert report.max_scale_rel_diff > 0.01
    else:  # transformers' scale is 1/(448/amax): largest code 448, only the rounding differs
        assert count["below_448"] == 0 and set(report.reasons) <= {"rounding"}
        assert report.code_bytes_equal == report.code_bytes
        assert report.max_scale_rel_diff < 1e-6
    line = report.line()
    assert f"{report.blocks_equal}/{report.blocks} blocks" in line
    for key in report.reasons:
        assert REASONS[key] in line


def test_no_report_for_a_plain_checkpoint(tmp_path):
    from mxrl.models import build_model, save_pretrained

    path = save_pretrained(build_model(FULL, seed=0), tmp_path / "hf", progress=False)
    model = from_pretrained(path)
    plan = resolve("fp8-block", {n: p.shape for n, p in model.named_parameters()})
    assert compare_with_source(path, plan, model) is None


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_convert_cli_end_to_end_prints_the_report(checkpoints, capsys, tmp_path):
    """(d) `mxrl convert --recipe fp8-block` on the FP8 checkpoint succeeds, prints the report
    line, and the converted checkpoint serves an engine."""
    path = checkpoints["rows-float"]
    out = tmp_path / "q"
    code, stdout, err = _run(capsys, "convert", "--recipe", "fp8-block", "--model", str(path),
                             "--out", str(out))  # fmt: skip
    assert code == 0, err
    model = from_pretrained(path)
    plan = resolve("fp8-block", {n: p.shape for n, p in model.named_parameters()})
    report = compare_with_source(path, plan, model)
    assert f"mxrl convert: {report.line()}" in stdout.splitlines()
    q_plan, _, records = read_quantized_checkpoint(out)
    assert q_plan.hash() == plan.hash()
    written = {r.name: r.value for r in records}
    tensors = load_file(path / "model.safetensors")
    same = 0  # the blocks convert wrote as the file has them: the report's count
    for key, q in tensors.items():
        target = target_of(key)
        if q.dtype == torch.float8_e4m3fn and plan[target.param].format is Format.FP8_BLOCK:
            value = written[target.param]
            s = tensors[hf_fp8.scale_key(key)]
            same += int(
                _block_equal(q, s, target.view(value.qdata), target.view(value.scale)).sum()
            )
    assert same == report.blocks_equal
    engine = Engine.from_checkpoint(out, tile=8)
    done = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0))
    assert len(done[0].tokens) == 4


def test_convert_cli_refuses_a_bad_fp8_config_writing_nothing(checkpoints, capsys, tmp_path):
    import shutil

    path = shutil.copytree(checkpoints["full-float"], tmp_path / "ck")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "compressed-tensors"
    (path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "q"
    code, _, err = _run(capsys, "convert", "--recipe", "fp8-block", "--model", str(path),
                        "--out", str(out))  # fmt: skip
    assert code == 2
    assert err.startswith("mxrl: error:") and len(err.strip().splitlines()) == 1
    assert "config.json" in err and "compressed-tensors" in err
    assert not out.exists()


def test_engine_from_an_fp8_checkpoint_generates(checkpoints):
    """(e) an engine built on the dequantized master, under fp8-block, generates."""
    model = from_pretrained(checkpoints["full-ue8m0"])
    engine = Engine(model, "fp8-block", tile=8)
    done = engine.generate([[5, 9, 2], [3, 4]], SamplingParams(max_new_tokens=5, seed=1))
    assert [len(c.tokens) for c in done] == [5, 5]


def test_train_logs_and_records_the_report(checkpoints, tmp_path, caplog):
    """`mxrl train`'s step: one INFO line, and an `fp8_source` event in the run record."""
    path = checkpoints["full-float"]
    model = from_pretrained(path)
    plan = resolve("fp8-block", {n: p.shape for n, p in model.named_parameters()})
    with caplog.at_level(logging.INFO, logger="mxrl.app.train"):
        report = fp8_source_report(SimpleNamespace(model=str(path)), model, plan)
    assert [r.getMessage() for r in caplog.records] == [f"mxrl train: {report.line()}"]
    record = RunRecord.create(tmp_path / "runs", "t")
    _record_fp8_source(record, report, 0)
    (event,) = record.events("fp8_source")
    assert event["blocks"] == report.blocks and event["reasons"] == report.reasons


def test_train_preflight_refuses_a_bad_quantization_config(checkpoints, tmp_path):
    """`mxrl train` refuses an unsupported quantization_config with its plan, before the load."""
    import shutil

    from mxrl.app.preflight import config_plan
    from mxrl.rl.config import TrainConfig

    path = shutil.copytree(checkpoints["full-float"], tmp_path / "ck")
    cfg = TrainConfig.from_dict({"model": str(path), "rl": {"recipe": "fp8-block"}})
    assert config_plan(cfg).recipe_name == "fp8-block"
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^model: .*config.json.*activation_scheme 'static'"):
        config_plan(cfg)


def test_expert_halves_off_the_block_grid_are_reported_as_such(tmp_path):
    """moe_intermediate_size 192: the fused gate_up_proj's 128-row blocks straddle gate and
    up, so no block of those file tensors can come back; the report says why."""
    from tests.models.fp8_checkpoints import PARTIAL

    path = write_fp8_checkpoint(tmp_path / "ck", PARTIAL)
    model = from_pretrained(path)
    recipe = {"name": "gate-up-fp8", "default": "bf16", "rules": [
        {"match": {"name": "*.mlp.experts.gate_up_proj"}, "format": "fp8_block",
         "block": [128, 128]}]}  # fmt: skip
    plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
    report = compare_with_source(path, plan, model)
    halves = 2 * 4 * 2  # layers x experts x (gate, up), each [192, 256]: 2 x 2 blocks
    assert (report.tensors, report.blocks, report.blocks_equal) == (halves, 4 * halves, 0)
    assert report.reasons == {"split": 4 * halves}
    assert report.not_compared == 2 * (4 + 4)  # attention and down_proj: bf16 in this plan
