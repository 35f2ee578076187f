"""Faults tier: `mxrl convert` on a broken HF checkpoint is refused under the contract of
tests/faults/harness.py (exit 2, one `mxrl: error:` line naming the culprit, no traceback, no
file changed, no --out created). Each case damages a copy of a tiny checkpoint in one way. (No
`mxrl` command loads a quantized checkpoint; their refusals are tested through the Python API in
tests/weights/test_checkpoint_checks.py.)"""

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxrl.models import save_pretrained
from tests.faults.harness import assert_refused, run_mxrl, snapshot
from tests.sync.helpers import tiny

WEIGHTS, CONFIG = "model.safetensors", "config.json"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny-moe"
    save_pretrained(tiny(seed=0), path)
    assert sorted(p.name for p in path.iterdir()) == [CONFIG, WEIGHTS]
    return path


def overwrite_bytes(at: int, data: bytes):
    def damage(d):
        raw = bytearray((d / WEIGHTS).read_bytes())
        raw[at : at + len(data)] = data
        (d / WEIGHTS).write_bytes(bytes(raw))

    return damage


def truncated(d):
    raw = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(raw[:-1000])


def edit_tensor(key_part: str, how):
    def damage(d):
        state = load_file(d / WEIGHTS)
        key = next(k for k in state if key_part in k)
        state[key] = how(state[key])
        save_file(state, str(d / WEIGHTS))

    return damage


def with_nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[3, 5] = float("nan")
    return t


def edit_config(**fields):
    def damage(d):
        config = json.loads((d / CONFIG).read_text())
        (d / CONFIG).write_text(json.dumps({**config, **fields}))

    return damage


CASES = [
    # (id, damage, the culprit the error line names)
    ("corrupt_header", overwrite_bytes(8, b"\xff" * 32), WEIGHTS),
    ("header_length_garbage", overwrite_bytes(0, struct.pack("<Q", 10**12)), WEIGHTS),
    ("truncated_weights", truncated, WEIGHTS),
    ("missing_weights", lambda d: (d / WEIGHTS).unlink(), WEIGHTS),
    ("config_does_not_parse", lambda d: (d / CONFIG).write_text('{"model_type": "qwen3_moe",'),
     CONFIG),
    ("missing_config", lambda d: (d / CONFIG).unlink(), CONFIG),
    ("nan_weight", edit_tensor("layers.0.self_attn.q_proj", with_nan),
     "model.layers.0.self_attn.q_proj.weight"),
    ("more_layers_in_config", edit_config(num_hidden_layers=5), "model.layers.4."),
    ("wrong_tensor_shape", edit_tensor("layers.1.self_attn.o_proj", lambda t: t[:, :32].clone()),
     "model.layers.1.self_attn.o_proj.weight: [64, 32], expected [64, 64]"),
]  # fmt: skip


@pytest.mark.parametrize(("damage", "culprit"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_convert_refuses_a_broken_hf_checkpoint(hf_dir, tmp_path, damage, culprit):
    model = shutil.copytree(hf_dir, tmp_path / "model")
    damage(model)
    out = tmp_path / "out"
    before = snapshot(tmp_path)
    args = ["convert", "--recipe", "nvfp4-dequantized", "--model", str(model), "--out", str(out)]
    result = run_mxrl(args, cwd=tmp_path)
    assert_refused(result, culprit, before, snapshot(tmp_path), fresh=[out])
    assert not out.exists()
