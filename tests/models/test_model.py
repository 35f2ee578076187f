"""Module naming (= canonical HF fused names), init, routing, masks, KV-cache hooks, config."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mxrl.arch import ModelConfig, builtin_config, hf_tensors, tensors_from_hf_config
from mxrl.models import CausalLM, build_model
from mxrl.nn import GroupedExperts
from tests.models.configs import CONFIGS
from tests.numerics import assert_bytes_equal

ALL_CONFIGS = {**CONFIGS, "tiny-moe": builtin_config("tiny-moe")}


def _ids(shape=(2, 9), vocab=64, seed=0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_state_dict_is_the_fused_hf_layout(name):
    cfg = ALL_CONFIGS[name]
    model = build_model(cfg, seed=0)
    ours = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    assert ours == tensors_from_hf_config(cfg, "fused")
    per_expert = [(k, tuple(v.shape)) for k, v in hf_tensors(model.state_dict(), "per_expert")]
    assert per_expert == tensors_from_hf_config(cfg, "per_expert")


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_projections_are_swappable_modules(name):
    """Every 2-D matmul weight belongs to an nn.Linear (embedding excepted) and routed experts
    to one GroupedExperts, so apply_plan can replace modules by name."""
    model = build_model(ALL_CONFIGS[name], seed=0)
    modules = dict(model.named_modules())
    for key, p in model.state_dict().items():
        owner, _, attr = key.rpartition(".")
        if key == "model.embed_tokens.weight":
            assert isinstance(modules[owner], nn.Embedding)
        elif p.dim() == 2:
            assert isinstance(modules[owner], nn.Linear), key
        elif p.dim() == 3:
            assert isinstance(modules[owner], GroupedExperts) and attr in (
                "gate_up_proj",
                "down_proj",
            )


def test_builtin_tiny_model_has_shared_experts_and_trains():
    model = build_model(builtin_config("tiny-moe"), seed=1)
    moe = model.model.layers[0].mlp
    assert moe.shared_expert is not None and moe.shared_expert_gate.weight.shape == (1, 64)
    logits, routing = model(_ids(), return_routing=True)
    assert len(routing) == 4 and all(r.shape == (2, 9, 2) for r in routing)
    logits.logsumexp(-1).mean().backward()
    for key in ("mlp.gate.weight", "mlp.shared_expert_gate.weight", "self_attn.q_norm.weight"):
        assert model.get_parameter(f"model.layers.0.{key}").grad.abs().sum() > 0, key


def test_build_model_init_is_seeded_and_dtype_independent():
    cfg = builtin_config("tiny-moe")
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    low = build_model(cfg, dtype=torch.bfloat16, seed=3)
    std = 0.02
    for (k, pa), pb, pl in zip(
        a.state_dict().items(), b.state_dict().values(), low.state_dict().values(), strict=True
    ):
        assert_bytes_equal(pa, pb, k)
        assert_bytes_equal(pl, pa.to(torch.bfloat16), k)
        if "norm" in k:
            assert torch.all(pa == 1), k
        elif pa.numel() > 1000:
            assert abs(pa.std().item() - std) < 0.1 * std, k
    assert not torch.equal(a.lm_head.weight, build_model(cfg, seed=4).lm_head.weight)


def test_tied_model_uses_the_embedding():
    model = build_model(CONFIGS["qwen3-tied"], seed=0)
    assert model.lm_head is None and "lm_head.weight" not in model.state_dict()
    h = torch.randn(1, 3, 64)
    assert torch.equal(model.logits(h), h @ model.model.embed_tokens.weight.T)


class ListCache:
    """A minimal KV cache: concatenates each layer's keys/values along the sequence."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update(self, layer_idx, k, v):
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k], dim=2)
            v = torch.cat([self.v[layer_idx], v], dim=2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return k, v


@pytest.mark.parametrize("name", ["qwen3_moe-norm-dense1", "qwen2_moe-shared", "tiny-moe"])
def test_kv_cache_hook_prefill_then_decode_matches_full_forward(name):
    model = build_model(ALL_CONFIGS[name], seed=2)
    ids = _ids((2, 10))
    with torch.no_grad():
        full = model(ids)
        cache = ListCache()
        pos = torch.arange(10)[None].expand(2, 10)
        parts = [model(ids[:, :6], position_ids=pos[:, :6], kv_cache=cache)]
        parts.append(model(ids[:, 6:8], position_ids=pos[:, 6:8], kv_cache=cache))  # chunk
        for t in (8, 9):  # one token at a time
            parts.append(model(ids[:, t : t + 1], position_ids=pos[:, t : t + 1], kv_cache=cache))
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="position_ids is required"):
        model(ids, kv_cache=ListCache())


def test_left_padding_gives_the_unpadded_logits():
    model = build_model(CONFIGS["qwen3_moe-norm-dense1"], seed=0)
    ids = _ids((1, 7))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.tensor([[0, 0, 0] + [1] * 7])
    with torch.no_grad():
        want = model(ids)
        got = model(padded, attention_mask=mask)
        bool_mask = torch.tril(torch.ones(10, 10, dtype=torch.bool)) & mask.bool()[:, None]
        got4 = model(padded, attention_mask=bool_mask[:, None] | torch.eye(10, dtype=torch.bool))
    assert (got[:, 3:] - want).abs().max().item() <= 1e-5
    assert torch.isfinite(got).all()
    assert (got4[:, 3:] - want).abs().max().item() <= 1e-5


def test_routing_replay():
    model = build_model(builtin_config("tiny-moe"), seed=0)
    ids = _ids()
    with torch.no_grad():
        logits, routing = model(ids, return_routing=True)
        replayed, again = model(ids, return_routing=True, replay_routing=routing)
        assert_bytes_equal(replayed, logits)
        assert all(torch.equal(a, b) for a, b in zip(again, routing, strict=True))
        other = [(r + 1) % 8 for r in routing]
        forced, used = model(ids, return_routing=True, replay_routing=other)
    assert all(torch.equal(a, b) for a, b in zip(used, other, strict=True))
    assert not torch.equal(forced, logits)
    with pytest.raises(ValueError, match="MoE layers"):
        model(ids, replay_routing=routing[:1])


def test_dense_model_returns_empty_routing():
    logits, routing = build_model(CONFIGS["qwen3-tied"], seed=0)(_ids(), return_routing=True)
    assert routing == [] and logits.shape == (2, 9, 64)


def test_bf16_forward_runs_in_bf16():
    model = build_model(builtin_config("tiny-moe"), dtype=torch.bfloat16, seed=0)
    assert model(_ids()).dtype == torch.bfloat16


# --- config ---------------------------------------------------------------------------------


def test_config_reads_transformers5_and_published_spellings():
    base = builtin_config("tiny-moe")
    hf5 = {k: v for k, v in base.items() if k not in ("num_experts", "rope_theta")}
    hf5 |= {"num_local_experts": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    c = ModelConfig.from_hf(hf5)
    assert c.num_experts == 8 and c.rope_theta == 5e5 and c.shared_expert_intermediate_size == 64
    assert ModelConfig.from_hf({**base, "rope_scaling": None}).rope_theta == 10000
    assert c.to_hf(dtype="bfloat16")["dtype"] == "bfloat16"
    assert c.to_hf()["architectures"] == ["Qwen3MoeForCausalLM"]


def test_config_layer_kinds():
    c = ModelConfig.from_hf(CONFIGS["qwen2_moe-norm-step2"])
    assert c.moe_layers == (1, 3) and not c.qk_norm and c.qkv_bias and not c.o_bias
    c = ModelConfig.from_hf(CONFIGS["qwen3_moe-norm-dense1"])
    assert c.moe_layers == (0,) and c.qk_norm and c.shared_expert_intermediate_size == 0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "llama"}, "model_type.*not supported"),
        ({"hidden_size": None}, "lacks 'hidden_size'"),
        ({"num_experts": None}, "lacks 'num_experts'"),
        ({"moe_intermediate_size": None}, "lacks 'moe_intermediate_size'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_config_errors_name_the_key(change, match):
    cfg = {k: v for k, v in {**builtin_config("tiny-moe"), **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(cfg)


@pytest.mark.parametrize("key", ["intermediate_size", "head_dim"])
def test_dense_qwen3_needs(key):
    cfg = copy.deepcopy(CONFIGS["qwen3-tied"])
    del cfg[key]
    with pytest.raises(ValueError, match=f"lacks '{key}'"):
        ModelConfig.from_hf(cfg)


def test_model_is_a_plain_module():
    model = build_model(builtin_config("tiny-moe"), seed=0)
    assert isinstance(model, CausalLM) and isinstance(model, nn.Module)
    assert model.moe_layer_indices == [0, 1, 2, 3]
