"""Logits and routing of mxrl.models against transformers' Qwen3 / Qwen3-MoE / Qwen2-MoE, loading
the checkpoints transformers writes (per expert) and its in-memory fused layout."""

from __future__ import annotations

import pytest
import torch

from mxrl.models import from_pretrained, save_pretrained
from tests.models.configs import CONFIGS, MOE_CONFIGS
from tests.models.hf_reference import hf_model, hf_routing, save_fused, save_hf

TOL = 1e-5


def _input_ids(vocab: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def reference(request, tmp_path_factory):
    """(config name, transformers model, its logits, dirs of its two checkpoint layouts)."""
    cfg = CONFIGS[request.param]
    model = hf_model(cfg)
    ids = _input_ids(cfg["vocab_size"])
    with torch.no_grad():
        logits = model(ids).logits
    root = tmp_path_factory.mktemp(request.param)
    dirs = {"hf": save_hf(model, root / "hf"), "fused": save_fused(model, root / "fused")}
    return request.param, model, ids, logits, dirs


@pytest.mark.parametrize("layout", ["hf", "fused"])
def test_logits_match_transformers(reference, layout):
    name, _, ids, want, dirs = reference
    model = from_pretrained(dirs[layout], progress=False)
    with torch.no_grad():
        got = model(ids)
    assert got.dtype == torch.float32
    assert _max_diff(got, want) <= TOL, f"{name} ({layout}): max |diff| {_max_diff(got, want)}"


def test_transformers_checkpoint_is_per_expert(reference):
    """What transformers' save_pretrained writes, so the per-expert path really is exercised."""
    name, _, _, _, dirs = reference
    from safetensors import safe_open

    with safe_open(str(dirs["hf"] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    if name.startswith("qwen3-"):
        assert not any(".experts." in k for k in keys)
    else:
        assert any(".mlp.experts.0.gate_proj.weight" in k for k in keys)
        assert not any(k.endswith("experts.gate_up_proj") for k in keys)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_our_saved_checkpoints_match_transformers(reference, layout, tmp_path):
    """Our save_pretrained (sharded, either layout) -> from_pretrained keeps the logits, and
    transformers itself loads what we write."""
    from tests.models.hf_reference import transformers

    name, _, ids, want, dirs = reference
    model = from_pretrained(dirs["hf"], progress=False)
    out = save_pretrained(model, tmp_path / "ours", layout, max_shard_size="40KB", progress=False)
    with torch.no_grad():
        assert _max_diff(from_pretrained(out, progress=False)(ids), want) <= TOL
    if layout == "per_expert":  # transformers 5 reads per-expert checkpoints (published format)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            assert _max_diff(theirs.eval()(ids).logits, want) <= TOL, name


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_routing_matches_transformers_topk(name, tmp_path):
    cfg = CONFIGS[name]
    hf = hf_model(cfg, seed=3)
    ids = _input_ids(cfg["vocab_size"], seed=5)
    want = hf_routing(hf, ids)
    model = from_pretrained(save_hf(hf, tmp_path / "ck"), progress=False)
    with torch.no_grad():
        logits, routing = model(ids, return_routing=True)
    assert len(routing) == len(want) == len(model.moe_layer_indices) > 0
    k = cfg["num_experts_per_tok"]
    for layer, got, ref in zip(model.moe_layer_indices, routing, want, strict=True):
        assert got.shape == (*ids.shape, k) and got.dtype == torch.int64
        assert torch.equal(got, ref), f"layer {layer}"
    assert logits.shape == (*ids.shape, cfg["vocab_size"])


@pytest.mark.parametrize("name", ["qwen3_moe-norm-dense1", "qwen2_moe-shared"])
def test_padded_batch_matches_transformers(name, tmp_path):
    """Left padding + attention_mask (positions counted from the first real token) against
    transformers given the same mask and position ids."""
    cfg = CONFIGS[name]
    hf = hf_model(cfg)
    ids = _input_ids(cfg["vocab_size"])
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = from_pretrained(save_hf(hf, tmp_path / "ck"), progress=False)(
            ids, attention_mask=mask
        )
    real = mask.bool()
    assert _max_diff(got[real], want[real]) <= TOL
    assert torch.isfinite(got).all()
