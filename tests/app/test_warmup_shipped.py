"""The demo's shipped SFT warm-up (mxrl/app/data/warmup/): it exists under the key the demo asks
for (a change to the task, the model config, the warm-up settings or the version moves the key:
regenerate it, see the failure message), it is what the demo loads by default, and
`shipped=False` (`mxrl demo --local-warmup`) ignores it."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from mxrl.app import demo
from mxrl.app.warmup import SHIPPED_DIR, warmed_up_model, warmup_key
from mxrl.arch import builtin_config

CONFIG = builtin_config("tiny-moe")


def _key() -> str:
    return warmup_key(CONFIG, demo.demo_task(-1), demo.WARMUP_STEPS, 0, 64, 3e-3)


def test_the_demo_warmup_is_shipped_under_its_current_key():
    key = _key()
    weights, meta = SHIPPED_DIR / f"{key}.safetensors", SHIPPED_DIR / f"{key}.json"
    assert weights.exists() and meta.exists(), (
        f"no shipped warm-up for key {key} (the demo's warm-up inputs or the version changed): "
        f"run `MXRL_CACHE=/tmp/w mxrl demo --local-warmup --steps 1 --seeds 1` and copy "
        f"/tmp/w/warmup/{key}.* to {SHIPPED_DIR}/ (remove the old pair)"
    )
    assert json.loads(meta.read_text())["steps"] == demo.WARMUP_STEPS
    shipped = sorted(p.name for p in SHIPPED_DIR.iterdir())
    assert shipped == [f"{key}.json", f"{key}.safetensors"], f"stale files: {shipped}"


def test_the_demo_loads_the_shipped_warmup_and_local_ignores_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MXRL_CACHE", str(tmp_path))
    key = _key()
    shipped = load_file(str(SHIPPED_DIR / f"{key}.safetensors"))
    model, info = warmed_up_model(CONFIG, demo.demo_task(-1), demo.WARMUP_STEPS)
    assert info["source"] == "shipped"
    for name, t in model.state_dict().items():
        assert torch.equal(t, shipped[name]), name
    # a cache entry under the same key with other weights: used only with shipped=False
    cache = tmp_path / "warmup"
    cache.mkdir()
    other = {k: v + 1 for k, v in shipped.items()}
    save_file(other, str(cache / f"{key}.safetensors"))
    shutil.copy(SHIPPED_DIR / f"{key}.json", cache / f"{key}.json")
    model, info = warmed_up_model(CONFIG, demo.demo_task(-1), demo.WARMUP_STEPS, shipped=False)
    assert info["source"] == "cache"
    name = next(iter(other))
    assert torch.equal(model.state_dict()[name], other[name])


def test_an_unreadable_cache_entry_is_trained_again_from_scratch(tmp_path, monkeypatch):
    """A cache entry that fails to load half-way (a tensor missing, the others changed) is
    trained again from the seed's initialisation, not from the half-loaded tensors."""
    monkeypatch.setenv("MXRL_CACHE", str(tmp_path))
    task = demo.demo_task(-1)
    clean, info = warmed_up_model(CONFIG, task, 3)
    assert info["source"] == "trained"
    weights = tmp_path / "warmup" / f"{warmup_key(CONFIG, task, 3, 0, 64, 3e-3)}.safetensors"
    state = load_file(str(weights))
    state.pop(next(iter(state)))
    save_file({k: v + 1 for k, v in state.items()}, str(weights))
    again, info = warmed_up_model(CONFIG, task, 3)
    assert info["source"] == "trained"
    for name, t in clean.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name
