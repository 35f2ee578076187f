"""mxrl.models' deepseek_v3 family against transformers' DeepseekV3ForCausalLM (the oracle,
`tests.models.deepseek_reference`): logits, routing (ids and weights), HF checkpoints in and out
(names identical to transformers' state_dict, e_score_correction_bias included).

Bit-exact logits (`torch.equal`) need two things the model does differently from transformers
on purpose, and which are set aside here, each for a stated reason:
- `exact_elementwise`: mxrl's SiLU, sigmoid (`mxrl.nn.invariant`) and its RoPE table
  (`RotaryEmbedding._cpu_table`) round differently from ATen's by an ulp so that a token's bytes
  do not depend on its batch; the fixture runs torch's own functions in their place, the ones
  transformers runs (the invariant functions' bound is tests/nn/test_invariant.py's).
- top-1 routing: transformers' experts loop feeds each expert its tokens slot by slot, mxrl's
  (`GroupedExperts`) token by token, and a CPU GEMM's row may round differently at another row
  position. With one expert per token the two orders are the same rows.
Every other configuration is compared with the routing exactly and the logits within 1e-5, as
tests/models/test_parity.py does for the Qwen families.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mxrl.arch import tensors_from_hf_config
from mxrl.models import build_model, from_pretrained, save_pretrained
from mxrl.models.layers import RotaryEmbedding
from mxrl.models.mla import DeepseekMoE
from mxrl.nn import invariant
from tests.models.deepseek_reference import CONFIGS, hf_deepseek
from tests.models.hf_reference import hf_routing, save_fused, save_hf, transformers

TOL = 1e-5


def _ids(vocab: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def exact_elementwise(monkeypatch):
    """torch's SiLU / sigmoid / RoPE angles in mxrl's model, as transformers computes them."""
    monkeypatch.setattr(invariant, "silu", F.silu)
    monkeypatch.setattr(invariant, "sigmoid", torch.sigmoid)
    monkeypatch.setattr(RotaryEmbedding, "_cpu_table", lambda self, pos: self._angles(pos))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_equal_transformers_bit_for_bit(name, exact_elementwise, tmp_path):
    cfg = {**CONFIGS[name], "num_experts_per_tok": 1}
    hf = hf_deepseek(cfg)
    ids = _ids(cfg["vocab_size"])
    with torch.no_grad():
        want = hf(ids).logits
        got = from_pretrained(save_hf(hf, tmp_path / "ck"), progress=False)(ids)
    assert torch.equal(got, want), f"{name}: max |diff| {(got - want).abs().max().item()}"


# YaRN variants: transformers 5's rope_parameters form, no mscale (attention factor from the
# factor alone, softmax scale unchanged), beta and truncate given
YARN = {
    "rope_parameters-no-mscale": {
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e4, "factor": 8.0,
                            "original_max_position_embeddings": 64},
    },
    "betas-untruncated": {
        "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32,
                         "beta_fast": 16, "beta_slow": 2, "truncate": False, "mscale_all_dim": 1.0},
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(YARN))
def test_yarn_logits_equal_transformers_bit_for_bit(name, exact_elementwise, tmp_path):
    cfg = {**CONFIGS["yarn-mscale"], **YARN[name], "num_experts_per_tok": 1}
    if "rope_parameters" in YARN[name]:
        del cfg["rope_scaling"]
    hf = hf_deepseek(cfg)
    assert hf.model.rotary_emb.rope_type == "yarn"
    ids = _ids(cfg["vocab_size"])
    with torch.no_grad():
        want = hf(ids).logits
        got = from_pretrained(save_hf(hf, tmp_path / "ck"), progress=False)(ids)
    assert torch.equal(got, want), f"{name}: max |diff| {(got - want).abs().max().item()}"
    # the config as given (not the rope_parameters transformers writes back) reads the same
    rope = build_model(cfg).model.rotary_emb
    assert torch.equal(rope.inv_freq(torch.device("cpu")), hf.model.rotary_emb.inv_freq)
    assert rope.attention_factor == hf.model.rotary_emb.attention_scaling


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("layout", ["hf", "fused"])
def test_logits_match_transformers(name, layout, tmp_path):
    cfg = CONFIGS[name]
    hf = hf_deepseek(cfg)
    ids = _ids(cfg["vocab_size"])
    save = save_hf if layout == "hf" else save_fused
    with torch.no_grad():
        want = hf(ids).logits
        got = from_pretrained(save(hf, tmp_path / "ck"), progress=False)(ids)
    assert (got - want).abs().max().item() <= TOL, name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_routing_ids_and_weights_equal_transformers(name, exact_elementwise, tmp_path):
    """Every MoE layer's experts equal transformers' choice for the model's own inputs, and on
    one input per layer the router's weights too (bias for the choice only, scaled, normed)."""
    cfg = CONFIGS[name]
    hf = hf_deepseek(cfg, seed=3)
    ids = _ids(cfg["vocab_size"], seed=5)
    model = from_pretrained(save_hf(hf, tmp_path / "ck"), progress=False)
    with torch.no_grad():
        _, routing = model(ids, return_routing=True)
    want = hf_routing(hf, ids)
    assert len(routing) == len(want) == len(model.moe_layer_indices) > 0
    for got, ref in zip(routing, want, strict=True):
        assert torch.equal(got, ref)
    x = torch.randn(40, cfg["hidden_size"], generator=torch.Generator().manual_seed(9))
    for layer in model.moe_layer_indices:
        with torch.no_grad():
            _, hf_w, hf_ids = hf.model.layers[layer].mlp.gate(x)
            ids_Tk, w_Tk = model.model.layers[layer].mlp.route(x)
        assert torch.equal(ids_Tk, hf_ids) and torch.equal(w_Tk, hf_w), f"layer {layer}"


def test_the_correction_bias_moves_the_choice_not_the_weights(exact_elementwise, tmp_path):
    """A test of the test: the random e_score_correction_bias changes some choices (so the
    routing checks above see it), and the weights stay the unbiased scores."""
    cfg = CONFIGS["qlora-grouped-shared1"]
    hf = hf_deepseek(cfg)
    block = from_pretrained(save_hf(hf, tmp_path / "ck"), progress=False).model.layers[1].mlp
    assert isinstance(block, DeepseekMoE)
    x = torch.randn(64, cfg["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ids, w = block.route(x)
        bias = block.gate.e_score_correction_bias.clone()
        block.gate.e_score_correction_bias.zero_()
        unbiased_ids, _ = block.route(x)
        block.gate.e_score_correction_bias.copy_(bias)
        _, replay_w = block.route(x, ids)
    assert not torch.equal(ids.sort(-1).values, unbiased_ids.sort(-1).values)
    assert torch.equal(w, replay_w)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_names_are_transformers_state_dict(name, tmp_path):
    cfg = CONFIGS[name]
    hf = hf_deepseek(cfg)
    model = from_pretrained(save_hf(hf, tmp_path / "ck"), progress=False)
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        theirs.pop("lm_head.weight")
    ours = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    assert dict(ours) == theirs
    assert ours == tensors_from_hf_config(cfg, "fused")
    for key, value in hf.state_dict().items():
        if key.endswith("e_score_correction_bias"):
            assert torch.equal(model.state_dict()[key], value)
            assert model.state_dict()[key].dtype == torch.float32


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_our_checkpoints_round_trip_and_transformers_loads_them(layout, tmp_path):
    cfg = CONFIGS["noqlora-bias-shared2-dense2"]
    hf = hf_deepseek(cfg)
    ids = _ids(cfg["vocab_size"])
    with torch.no_grad():
        want = hf(ids).logits
    model = from_pretrained(save_hf(hf, tmp_path / "ck"), progress=False)
    out = save_pretrained(model, tmp_path / "ours", layout, max_shard_size="40KB", progress=False)
    again = from_pretrained(out, progress=False)
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))
    if layout == "per_expert":
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, attn_implementation="sdpa", experts_implementation="eager"
        )
        with torch.no_grad():
            assert torch.equal(theirs.eval()(ids).logits, want)


def test_bf16_save_and_load_keep_the_correction_bias_fp32(tmp_path):
    from safetensors import safe_open

    hf = hf_deepseek(CONFIGS["qlora-grouped-shared1"])
    model = from_pretrained(save_hf(hf, tmp_path / "ck"), dtype=torch.bfloat16, progress=False)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert model.get_parameter(bias).dtype == torch.float32
    assert torch.equal(model.get_parameter(bias), hf.get_buffer(bias))
    out = save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16, progress=False)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor(bias).dtype == torch.float32
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("mtp", [None, 1, 0])
def test_the_releases_mtp_layer_is_skipped_as_transformers_does(mtp, tmp_path):
    """A release's multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`, here its
    decoder tensors and the MTP head's eh_proj / enorm / hnorm) is neither built nor loaded when
    config.json declares it (num_nextn_predict_layers, transformers' default 1 when absent);
    with num_nextn_predict_layers 0 its tensors are unknown, and refused."""
    import json

    from safetensors.torch import load_file, save_file

    cfg = CONFIGS["qlora-grouped-shared1"]
    hf = hf_deepseek(cfg)
    ids = _ids(cfg["vocab_size"])
    with torch.no_grad():
        want = hf(ids).logits
    path = save_hf(hf, tmp_path / "ck")
    tensors = load_file(path / "model.safetensors")
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    last = f"model.layers.{n - 1}."
    mtp_tensors = {
        k.replace(last, f"model.layers.{n}."): v.clone() for k, v in tensors.items() if last in k
    }
    mtp_tensors[f"model.layers.{n}.eh_proj.weight"] = torch.ones(h, 2 * h)
    mtp_tensors[f"model.layers.{n}.enorm.weight"] = torch.ones(h)
    save_file(tensors | mtp_tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.pop("num_nextn_predict_layers", None)
    config.pop("num_mtp_layers", None)
    if mtp is not None:
        config["num_nextn_predict_layers"] = mtp
    (path / "config.json").write_text(json.dumps(config))
    if mtp == 0:
        with pytest.raises(ValueError, match=rf"unknown tensors: model\.layers\.{n}\."):
            from_pretrained(path, progress=False)
        return
    with torch.no_grad():
        got = from_pretrained(path, progress=False)(ids)
    assert (got - want).abs().max().item() <= TOL
