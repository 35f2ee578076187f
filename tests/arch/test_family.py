"""The family table (docs/design.md §4.3): every registered family's tensor names are covered by
its own pieces, and no name matches two pieces, so `classify` may try them in any order; the
registry and `Family`'s refusals; `ModelConfig` through each built family and back."""

import dataclasses

import pytest

from mxrl.arch import (
    EXPERT_LAYOUTS,
    FAMILIES,
    Family,
    ModelConfig,
    builtin_config,
    family,
    tensors_from_hf_config,
)
from mxrl.arch.names import PIECES, matching_pieces
from mxrl.arch.qwen3 import QWEN3
from tests.arch import hf_configs

CONFIGS = [
    hf_configs.QWEN3_30B_A3B,
    hf_configs.QWEN3_0_6B,
    {**hf_configs.QWEN3_0_6B, "attention_bias": True},
    hf_configs.QWEN2_MOE_A2_7B,
    hf_configs.DEEPSEEK_V3_SMALL,
    {**hf_configs.DEEPSEEK_V3_SMALL, "q_lora_rank": None, "attention_bias": True},
    builtin_config("tiny-moe"),
]
CASES = [(cfg, layout) for cfg in CONFIGS for layout in EXPERT_LAYOUTS]
GLOBAL = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


def _id(case):
    cfg, layout = case
    return f"{cfg['model_type']}-{cfg['num_hidden_layers']}-{cfg.get('q_lora_rank', '')}-{layout}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_every_name_is_one_piece_of_its_own_family(case):
    cfg, layout = case
    own = family(cfg["model_type"]).pieces
    for name, _ in tensors_from_hf_config(cfg, layout):
        if name in GLOBAL:
            assert matching_pieces(name) == []
            continue
        pieces = matching_pieces(name)
        assert len(pieces) == 1, f"{name} matches {[p.name for p in pieces]}"
        assert pieces[0] in own, f"{name}: piece {pieces[0].name} is not one of its family's"


def test_the_families_pieces_are_the_pieces():
    used = {p.name for f in FAMILIES for p in f.pieces}
    assert used == {p.name for p in PIECES}
    assert len({p.name for p in PIECES}) == len(PIECES)


def test_the_registry():
    assert [f.model_type for f in FAMILIES] == ["qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3"]
    assert family("qwen3") is QWEN3
    with pytest.raises(ValueError, match="'llama' is not a registered family; known: qwen3, "):
        family("llama")
    with pytest.raises(ValueError, match="model_type 'llama' is not supported; supported model"):
        tensors_from_hf_config({**hf_configs.QWEN3_0_6B, "model_type": "llama"})


def test_family_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match="model_type must be a non-empty str"):
        dataclasses.replace(QWEN3, model_type="")
    with pytest.raises(TypeError, match="pieces must be a non-empty tuple"):
        dataclasses.replace(QWEN3, pieces=())
    with pytest.raises(ValueError, match="a names-only family"):
        Family("x", None, QWEN3.pieces, QWEN3.layer_tensors, QWEN3.config_fields)


@pytest.mark.parametrize(
    "cfg",
    [
        hf_configs.QWEN3_0_6B,
        hf_configs.QWEN3_30B_A3B,
        hf_configs.QWEN2_MOE_A2_7B,
        builtin_config(),
        {**hf_configs.DEEPSEEK_V3_SMALL, "n_group": 2, "topk_group": 2},
        {**hf_configs.DEEPSEEK_V3_SMALL, "n_group": 1, "topk_group": 1, "q_lora_rank": None},
        {
            **hf_configs.DEEPSEEK_V3_SMALL,
            "n_group": 2,
            "topk_group": 2,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
            },
        },
    ],
    ids=lambda c: c["model_type"],
)
def test_model_config_round_trips_through_its_family(cfg):
    config = ModelConfig.from_hf(cfg)
    written = dataclasses.replace(config, hf_config={}).to_hf()
    assert written["architectures"] == [family(cfg["model_type"]).architecture]
    assert ModelConfig.from_hf(written) == config


def test_a_names_only_family_is_not_built(monkeypatch):
    """A registered family without an architecture resolves recipes but is not built (no
    registered family is names-only since deepseek_v3 is built: a stand-in is registered)."""
    import mxrl.arch

    names_only = dataclasses.replace(QWEN3, model_type="names_only", architecture=None,
                                     config_fields=None, hf_fields=None)  # fmt: skip
    monkeypatch.setattr(mxrl.arch, "FAMILIES", (*FAMILIES, names_only))
    cfg = {**hf_configs.QWEN3_0_6B, "model_type": "names_only"}
    assert tensors_from_hf_config(cfg) == tensors_from_hf_config(hf_configs.QWEN3_0_6B)
    with pytest.raises(ValueError, match=r"'names_only' is not supported by mxrl\.models"):
        ModelConfig.from_hf(cfg)
