"""benchmarks/families.py: the DeepSeek-V3 slice has Moonlight-16B-A3B's published shapes (the
table below is moonshotai/Moonlight-16B-A3B's config.json, written here, not read from the code
under test), whose full depth counts 16B parameters with 3B active per token; the Qwen slice is
unchanged."""

from __future__ import annotations

import pytest
import torch

from mxrl.models.model import CausalLM
from tests.benchmark_scripts import load_benchmark

MOONLIGHT = {  # moonshotai/Moonlight-16B-A3B config.json
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "num_attention_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "moe_intermediate_size": 1408,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.446,
    "norm_topk_prob": True,
    "rope_theta": 50000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "num_hidden_layers": 27,
    "vocab_size": 163840,
}


@pytest.fixture(scope="module")
def families():
    with pytest.MonkeyPatch.context() as mp:
        yield load_benchmark("families", mp)


def test_deepseek_slice_has_moonlight_shapes(families):
    m = MOONLIGHT
    c = families.model_config(
        layers=4, vocab=32000, tiny=False, family="deepseek-v3"
    )  # the benchmark's depth and vocabulary; the rest Moonlight's
    assert (c.model_type, c.num_hidden_layers, c.vocab_size) == ("deepseek_v3", 4, 32000)
    got = {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "q_lora_rank": c.q_lora_rank or None,  # mxrl: 0 for a single q_proj
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.head_dim,  # mxrl: head_dim is the RoPE part under MLA
        "v_head_dim": c.v_head_dim,
        "n_routed_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "n_shared_experts": c.shared_expert_intermediate_size // c.moe_intermediate_size,
        "moe_intermediate_size": c.moe_intermediate_size,
        "first_k_dense_replace": c.num_hidden_layers - len(c.moe_layers),
        "n_group": c.n_group,
        "topk_group": c.topk_group,
        "routed_scaling_factor": c.routed_scaling_factor,
        "norm_topk_prob": c.norm_topk_prob,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
    }
    assert got == {k: m[k] for k in got}
    assert c.moe_layers == (1, 2, 3) and c.scoring_func == "sigmoid" and c.rope_scaling == ()
    assert (
        families.MOONLIGHT_16B_A3B_LAYER["max_position_embeddings"] == m["max_position_embeddings"]
    )


def test_full_depth_moonlight_counts_16b_params_3b_active(families):
    config = families.model_config(
        layers=MOONLIGHT["num_hidden_layers"], vocab=MOONLIGHT["vocab_size"], tiny=False,
        family="deepseek-v3",
    )  # fmt: skip
    with torch.device("meta"):
        counts = families.param_counts(CausalLM(config))
    assert 15.5e9 < counts["num_params"] < 16.5e9  # "16B"
    assert 2.5e9 < counts["active_params_per_token"] < 3.5e9  # "A3B"


def test_qwen_slice_is_qwen3_30b_a3b(families):
    c = families.model_config(layers=2, vocab=32000, tiny=False)
    assert c.model_type == "qwen3_moe" and not c.is_mla
    got = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert got == (2048, 32, 4, 128)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (128, 8, 768)


def test_unknown_family_is_refused(families):
    with pytest.raises(ValueError, match="qwen3-moe, deepseek-v3"):
        families.model_config(layers=1, vocab=8, tiny=True, family="llama")


def test_hf_peer_is_the_same_model(families, tmp_path):
    """The HF columns' model: the tiny DeepSeek slice through save_pretrained, loaded by
    transformers as the scripts load it, gives our logits (fp32, 1e-5)."""
    import transformers

    from mxrl.models import build_model, save_pretrained

    config = families.model_config(layers=3, vocab=128, tiny=True, family="deepseek-v3")
    model = build_model(config, seed=0).eval()
    save_pretrained(model, tmp_path / "ck", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ck", dtype=torch.float32, experts_implementation="grouped_mm"
    ).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM" and hf.config.q_lora_rank is None
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-5)
