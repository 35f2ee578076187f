"""HF fine-grained FP8 checkpoints load as their dequantized values, checked against
transformers' own quantizer and dequantizer; every malformed one is refused before a byte is
copied or written."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxrl.arch.experts import target_of
from mxrl.formats import QTensor
from mxrl.formats.constants import Format
from mxrl.formats.fp8_block import dequantize_fp8_block
from mxrl.models import from_pretrained, hf_fp8
from mxrl.weights import convert_checkpoint
from tests.models.fp8_checkpoints import FULL, PARTIAL, tf_dequantize, write_fp8_checkpoint
from tests.numerics import assert_bytes_equal

CASES = {
    "full-float": (FULL, "float", None),
    "partial-bf16-scales": (PARTIAL, "float", torch.bfloat16),
    "full-ue8m0": (FULL, "ue8m0", None),  # transformers stores float8_e8m0fnu scales
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {
        name: write_fp8_checkpoint(root / name, cfg, scale_fmt=fmt, scale_dtype=sd)
        for name, (cfg, fmt, sd) in CASES.items()
    }


def _mismatches(model, path) -> list[str]:
    """Every tensor of the file whose loaded value differs from transformers' fp32
    dequantization (FP8 tensors) or from the stored value (the others)."""
    params = dict(model.named_parameters())
    tensors = load_file(path / "model.safetensors")
    bad = []
    for key, stored in tensors.items():
        if key.endswith(hf_fp8.SCALE_SUFFIX):
            continue
        if stored.dtype == torch.float8_e4m3fn:
            want = tf_dequantize(stored, tensors[hf_fp8.scale_key(key)])
        else:
            want = stored.to(torch.float32)
        if key == "lm_head.weight" and "lm_head.weight" not in params:
            continue
        target = target_of(key)
        got = target.view(params[target.param])
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            bad.append(key)
    return bad


@pytest.mark.parametrize("case", CASES)
def test_loads_transformers_dequantization_bit_for_bit(checkpoints, case):
    """(a) the master is fl(q * s) per 128x128 block in fp32, partial edge blocks included,
    = transformers' `Fp8Dequantize` = mxrl's own `dequantize` of the fp8_block QTensor; the
    bf16 tensors are copied exactly."""
    path = checkpoints[case]
    model = from_pretrained(path)
    assert _mismatches(model, path) == []
    tensors = load_file(path / "model.safetensors")
    fp8 = [k for k, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 2 * (4 + 3 * 4)  # 2 layers x (q, k, v, o + 4 experts x gate, up, down)
    params = dict(model.named_parameters())
    checked = 0
    for key in fp8:
        q, s = tensors[key], tensors[hf_fp8.scale_key(key)].to(torch.float32)
        if q.shape[1] % 128:
            continue  # mxrl's fp8_block QTensor takes whole column blocks only
        qt = QTensor(qdata=q.view(torch.uint8), scale=s, fmt=Format.FP8_BLOCK, shape=q.shape)
        target = target_of(key)
        assert_bytes_equal(target.view(params[target.param]), dequantize_fp8_block(qt), key)
        checked += 1
    assert checked >= 8


def test_a_wrong_edge_block_mapping_is_caught(checkpoints, monkeypatch):
    """The check above fails for a dequantization that maps the rows of a partial edge block
    to the wrong scale (the block height taken as N / ceil(N / 128), as a stretched grid)."""
    right = hf_fp8.dequantize

    def stretched(q, scale, block=hf_fp8.BLOCK):
        rows = -(-q.shape[0] // scale.shape[0])
        cols = -(-q.shape[1] // scale.shape[1])
        s = scale.to(torch.float32).repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return q.to(torch.float32) * s[: q.shape[0], : q.shape[1]]

    path = checkpoints["partial-bf16-scales"]
    monkeypatch.setattr(hf_fp8, "dequantize", stretched)
    bad = _mismatches(from_pretrained(path), path)
    assert "model.layers.0.self_attn.k_proj.weight" in bad  # [192, 256]: rows 96..127
    assert "model.layers.0.self_attn.q_proj.weight" not in bad  # whole blocks: same mapping
    monkeypatch.setattr(hf_fp8, "dequantize", right)


def test_bf16_master_warns_when_the_values_are_rounded(checkpoints, caplog):
    """Dtype rule: q * s with an fp32 scale is generally not a bf16 value (one warning); with
    power-of-two (ue8m0) scales it is, and the bf16 master equals the fp32 one."""
    with caplog.at_level(logging.WARNING, logger="mxrl.models.hf_checkpoint"):
        fp32 = from_pretrained(checkpoints["full-float"])
        bf16 = from_pretrained(checkpoints["full-float"], dtype=torch.bfloat16)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not powers of two" in warnings[0], warnings
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dict(bf16.named_parameters())[name].float(),
                           dict(fp32.named_parameters())[name])  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mxrl.models.hf_checkpoint"):
        fp32 = from_pretrained(checkpoints["full-ue8m0"])
        bf16 = from_pretrained(checkpoints["full-ue8m0"], dtype=torch.bfloat16)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    for (n, a), (_, b) in zip(fp32.named_parameters(), bf16.named_parameters(), strict=True):
        assert_bytes_equal(b.float(), a, n)


def test_convert_loads_an_fp8_checkpoint_in_float32(checkpoints, tmp_path, monkeypatch):
    """config.json says torch_dtype bfloat16 (as releases do); convert loads float32."""
    path = checkpoints["full-float"]
    config = json.loads((path / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    import mxrl.weights.convert as convert

    seen = []

    def spy(model_dir, dtype, **kw):
        seen.append(dtype)
        return from_pretrained(model_dir, dtype, **kw)

    monkeypatch.setattr(convert, "from_pretrained", spy)
    convert_checkpoint(path, "fp8-block", tmp_path / "q", progress=False)
    assert seen == [torch.float32]


def _config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    for k, v in changes.items():
        if v is None:
            qc.pop(k, None)
        else:
            qc[k] = v
    (path / "config.json").write_text(json.dumps(config))


def _tensors(path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


Q = "model.layers.0.self_attn.q_proj.weight"
QS = "model.layers.0.self_attn.q_proj.weight_scale_inv"
E = "model.layers.1.mlp.experts.2.down_proj.weight"
ES = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"


def _no_config(path):
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))


BAD = {
    "compressed-tensors": (lambda p: _config(p, quant_method="compressed-tensors"),
                           ["config.json", "quant_method", "compressed-tensors"]),
    "modelopt": (lambda p: _config(p, quant_method="modelopt"), ["config.json", "modelopt"]),
    "fmt-e5m2": (lambda p: _config(p, fmt="e5m2"), ["config.json", "fmt 'e5m2'"]),
    "static": (lambda p: _config(p, activation_scheme="static"),
               ["config.json", "activation_scheme 'static'"]),
    "no-block": (lambda p: _config(p, weight_block_size=None),
                 ["config.json", "weight_block_size None"]),
    "block-64": (lambda p: _config(p, weight_block_size=[64, 64]),
                 ["config.json", "weight_block_size [64, 64]"]),
    "scale-fmt": (lambda p: _config(p, scale_fmt="e4m3"), ["config.json", "scale_fmt 'e4m3'"]),
    "no-scale": (lambda p: _tensors(p, lambda t: t.pop(QS)),
                 ["without their weight_scale_inv", Q, "model.safetensors"]),
    "no-weight": (lambda p: _tensors(p, lambda t: t.update({Q: t[Q].to(torch.bfloat16)})),
                  ["weight_scale_inv without an FP8 weight", QS, "model.safetensors"]),
    "orphan-scale": (lambda p: _tensors(p, lambda t: t.update({"x.weight_scale_inv": t[QS].clone()})),
                     ["weight_scale_inv without an FP8 weight", "x.weight_scale_inv"]),
    "scale-shape": (lambda p: _tensors(p, lambda t: t.update({ES: t[ES][:1].contiguous()})),
                    ["wrong shape", ES, "[1, 1], expected [2, 1]", "[256, 128]"]),
    "no-config": (_no_config, ["64 FP8 tensors without quantization_config",
                               "F8_E4M3 in model.safetensors", "config.json"]),
    "nan-scale": (lambda p: _tensors(p, lambda t: t[ES].view(-1)[1].fill_(float("nan"))),
                  [ES, "nan", "block (1, 0)"]),
    "nan-code": (lambda p: _tensors(p, lambda t: t[E].view(torch.uint8)[3, 5].fill_(0x7F)),
                 [E, "nan", "(3, 5)"]),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_malformed_fp8_checkpoints_are_refused_naming_file_and_tensor(checkpoints, tmp_path, case):
    """(c) each problem is a ValueError naming the file and the tensor or field, and a refused
    convert writes nothing."""
    path = shutil.copytree(checkpoints["full-float"], tmp_path / "ck")
    edit, words = BAD[case]
    edit(path)
    with pytest.raises(ValueError) as e:
        from_pretrained(path)
    for word in words:
        assert word in str(e.value), (word, str(e.value))
    out = tmp_path / "out"
    with pytest.raises(ValueError):
        convert_checkpoint(path, "fp8-block", out, progress=False)
    assert not out.exists()


def test_all_pairing_problems_are_listed_at_once(checkpoints, tmp_path):
    path = shutil.copytree(checkpoints["full-float"], tmp_path / "ck")

    def edit(t):
        t.pop(QS)
        t[ES] = t[ES][:1].contiguous()

    _tensors(path, edit)
    with pytest.raises(ValueError) as e:
        from_pretrained(path)
    assert Q in str(e.value) and ES in str(e.value)
