"""Pinned: what every tensor of every test config classifies as, and every preset's plan over it.

`classification_pins.json` was written from the code before the family table split the name
patterns, the tensor lists and the config switches into one file per family (docs/design.md
§4.3): for each config of tests/arch/hf_configs.py and the built-in tiny-moe, in both expert
layouts, the sha256 of [name, shape, kind, layer, expert, role] for every tensor in HF order,
and each preset's plan hash (or the first words of its refusal). A family table that sends a
pattern to the wrong piece changes a Kind, hence a plan and its hash: this test names which.
Never regenerate the file to make this pass.
"""

import hashlib
import json
from pathlib import Path

import pytest

from mxrl.arch import EXPERT_LAYOUTS, builtin_config, classify_tensors, tensors_from_hf_config
from mxrl.recipe import list_presets, resolve
from tests.arch import hf_configs

PINS = json.loads((Path(__file__).parent / "classification_pins.json").read_text())
CONFIGS = {
    "qwen3_30b_a3b": hf_configs.QWEN3_30B_A3B,
    "qwen3_0_6b": hf_configs.QWEN3_0_6B,
    "qwen2_moe_a2_7b": hf_configs.QWEN2_MOE_A2_7B,
    "deepseek_v3_small": hf_configs.DEEPSEEK_V3_SMALL,
    "builtin_tiny_moe": builtin_config("tiny-moe"),
}
CASES = [(c, layout) for c in CONFIGS for layout in EXPERT_LAYOUTS]


def test_the_pins_cover_every_case():
    assert sorted(PINS) == sorted(f"{c}/{layout}" for c, layout in CASES)


@pytest.mark.parametrize(("config", "layout"), CASES)
def test_classification_and_plan_hashes_are_pinned(config, layout):
    pin = PINS[f"{config}/{layout}"]
    tensors = tensors_from_hf_config(CONFIGS[config], layout)
    infos = classify_tensors(name for name, _ in tensors)
    rows = [
        [n, list(s), str(infos[n].kind), infos[n].layer, infos[n].expert, infos[n].role]
        for n, s in tensors
    ]
    assert len(tensors) == pin["tensors"]
    assert hashlib.sha256(json.dumps(rows).encode()).hexdigest() == pin["classification"]
    plans = {}
    for preset in list_presets():
        try:
            plans[preset] = resolve(preset, tensors).hash()
        except ValueError as err:
            plans[preset] = "refused: " + str(err).split(":")[0]
    assert plans == pin["plans"]
