"""The deepseek_v3 family in training: apply_plan under every preset (MLA, routers and shared
experts kept in high precision by the presets' rules, e_score_correction_bias fp32, never
quantized, never trained), a few optimizer steps learn, routing replay of ids (weights from the
current router), the audit of `mxrl recipe show`, HF fine-grained FP8 checkpoints, and every
config field mxrl does not implement refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from mxrl.arch import ModelConfig
from mxrl.cli import main
from mxrl.models import build_model, from_pretrained, hf_fp8
from mxrl.models.mla import DeepseekMoE, MLAttention, SigmoidRouter
from mxrl.nn import QExperts, QLinear, apply_plan
from mxrl.recipe import resolve
from mxrl.recipe.plan import NOT_MATMUL
from tests.models.deepseek_reference import CONFIGS
from tests.nn.test_apply_plan import training_losses

PRESETS = [
    "bf16",
    "mxfp8",
    "mxfp8-hp",
    "mxfp8-dequantized",
    "nvfp4-hp",
    "nvfp4-dequantized",
    "nvfp4-4over6-hp",
    "fp8-block",
    "fp8-block-quantized",
]
# every quantized K a multiple of 128 (fp8-block's blocks); 4 layers: layer 0 dense, the last
# one in the presets' "last 15%" (bf16)
WIDE = {
    **CONFIGS["qlora-grouped-shared1"],
    "hidden_size": 128,
    "intermediate_size": 128,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
}


def _model(seed: int = 1) -> nn.Module:
    return build_model(WIDE, seed=seed)


def test_presets_cover_the_preset_folder():
    from importlib import resources

    names = {
        p.name.removesuffix(".yaml") for p in (resources.files("mxrl.recipe") / "presets").iterdir()
    }
    assert names == set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_trains_and_keeps_the_exceptions(preset):
    torch.manual_seed(0)
    model = _model()
    swaps = apply_plan(model, resolve(preset, {n: p.shape for n, p in model.named_parameters()}))
    assert (len(swaps) > 0) == (preset != "bf16")
    for layer in model.model.layers:
        attn = layer.self_attn
        assert isinstance(attn, MLAttention)
        for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            assert type(getattr(attn, proj)) is nn.Linear, proj  # MLA: bf16 in every preset
        if isinstance(layer.mlp, DeepseekMoE):
            assert type(layer.mlp.gate) is SigmoidRouter
            assert type(layer.mlp.shared_experts.gate_proj) is nn.Linear
            quantized = preset != "bf16" and layer.layer_idx < 3
            assert isinstance(layer.mlp.experts, QExperts) == quantized
    dense = model.model.layers[0].mlp.gate_proj
    assert isinstance(dense, QLinear) == (preset != "bf16" and not preset.startswith("nvfp4"))
    biases = [m.gate.e_score_correction_bias for m in model.modules() if isinstance(m, DeepseekMoE)]
    before = [b.clone() for b in biases]
    losses = training_losses(model)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5, losses
    for b, b0 in zip(biases, before, strict=True):
        assert b.dtype == torch.float32 and b.grad is None and torch.equal(b, b0)


def test_a_quantized_router_is_refused_by_name():
    model = _model()
    recipe = {
        "name": "router-fp8",
        "default": "bf16",
        "rules": [{"match": {"kind": "router"}, "format": "mxfp8"}],
    }
    plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
    with pytest.raises(ValueError, match=r"mlp\.gate\.weight \(SigmoidRouter\) is mxfp8.*bf16"):
        apply_plan(model, plan)


def test_router_runs_in_fp32_under_bf16_autocast():
    model = _model()
    model.set_training_options(compute_dtype=torch.bfloat16)
    block = model.model.layers[1].mlp
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    with model.autocast("cpu"):
        scores = block.gate.scores(x)
    assert scores.dtype == torch.float32
    want = torch.sigmoid(nn.functional.linear(x.double(), block.gate.weight.double()))
    assert (scores.double() - want).abs().max().item() < 1e-6  # not bf16's 4e-3


def test_routing_replay_forces_ids_weights_from_the_current_router():
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, routing = _model(seed=1)(ids, return_routing=True)
        other = _model(seed=2)
        got, replayed = other(ids, return_routing=True, replay_routing=routing)
        free_logits, free = other(ids, return_routing=True)
    assert all(torch.equal(a, b) for a, b in zip(replayed, routing, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(free, routing, strict=True))
    # the same forward with each router's selection replaced by the recorded ids (weights the
    # router's own scores at them, as without replay)
    blocks = [m for m in other.modules() if isinstance(m, DeepseekMoE)]
    for block, ids_BSk in zip(blocks, routing, strict=True):
        block.gate.select = lambda scores, ids=ids_BSk: ids.reshape(-1, ids.shape[-1])
    with torch.no_grad():
        forced = other(ids)
    assert torch.equal(got, forced) and not torch.equal(got, free_logits)


def test_recipe_show_audits_mla_router_and_bias(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(WIDE))
    for preset in ("mxfp8", "fp8-block", "nvfp4-hp"):
        assert main(["recipe", "show", preset, "--model", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        rows = {
            line.split()[0]: re.split(r"\s{2,}", line)
            for line in out.splitlines()
            if line.startswith("model.")
        }
        for layer in range(4):
            a = f"model.layers.{layer}.self_attn."
            assert rows[a + "kv_b_proj.weight"][4] == "bf16"
        for layer in (1, 2, 3):
            m = f"model.layers.{layer}.mlp.gate."
            assert rows[m + "weight"][4] == "bf16"
            # never quantized; the model holds it in fp32 (the plan's "bf16": high precision)
            assert rows[m + "e_score_correction_bias"][4:] == ["bf16", NOT_MATMUL]


# Fields mxrl does not implement: each refused with the field named, by ModelConfig.from_hf and
# by the CLI as one `mxrl: error:` line.
REFUSED = {
    "scoring_func": ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    "topk_method": ({"topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy'"),
    "moe_layer_freq": ({"moe_layer_freq": 2}, "moe_layer_freq 2 is not supported"),
    "rope_scaling": (
        {"rope_scaling": {"type": "linear", "factor": 4.0}},
        "rope_scaling: rope type 'linear' is not supported; mxrl.models implements 'default' "
        "and 'yarn' RoPE",
    ),
    "rope_parameters": (
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}},
        "rope_parameters: rope type 'dynamic' is not supported",
    ),
    "yarn_factor": (
        {"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 64}},
        "rope_scaling: yarn needs its factor",
    ),
    "yarn_key": (
        {"rope_scaling": {"type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}},
        r"rope_scaling: yarn parameter\(s\) \['partial_rotary_factor'\] are not supported",
    ),
    "num_key_value_heads": ({"num_key_value_heads": 2}, "num_key_value_heads 2 != "),
    "n_group": ({"n_group": 3}, r"n_group \(3\) must divide n_routed_experts \(8\)"),
    "topk_group": ({"topk_group": 5}, r"topk_group \(5\) must be in 1..n_group \(4\)"),
    "null": ({"n_group": None}, "n_group is null"),
    "experts_per_tok": ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) exceeds"),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unimplemented_fields_are_refused_by_name(case, tmp_path, capsys):
    change, message = REFUSED[case]
    cfg = {**CONFIGS["qlora-grouped-shared1"], **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code = main(
        ["convert", "--recipe", "bf16", "--model", str(tmp_path), "--out", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("mxrl: error:") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_fine_grained_fp8_checkpoint_loads(tmp_path):
    """A DeepSeek-V3-style FP8 release (every linear but the router and the LM head, MLA
    included, in E4M3 with 128x128 scales, made by transformers' quantizer) loads as
    transformers' dequantization of each weight, the rest as stored."""
    from safetensors.torch import load_file, save_file

    from mxrl.arch.experts import target_of
    from mxrl.models import save_pretrained
    from tests.models.fp8_checkpoints import tf_dequantize, tf_quantize

    model = _model()
    path = save_pretrained(model, tmp_path / "ck", "per_expert", dtype=torch.bfloat16)
    tensors = load_file(path / "model.safetensors")
    quantized = (".q_a_proj.weight", ".q_b_proj.weight", ".kv_a_proj_with_mqa.weight",
                 ".kv_b_proj.weight", ".o_proj.weight", "_proj.weight")  # fmt: skip
    out = {}
    for key, t in tensors.items():
        if key.endswith(quantized) and ".layers." in key and ".gate." not in key:
            q, s = tf_quantize(t)
            out[key], out[key.removesuffix(".weight") + hf_fp8.SCALE_SUFFIX] = q, s
        else:
            out[key] = t
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (path / "config.json").write_text(json.dumps(config))
    loaded = from_pretrained(path, progress=False)
    params = dict(loaded.named_parameters())
    fp8 = [k for k, t in out.items() if t.dtype == torch.float8_e4m3fn]
    assert any("kv_b_proj" in k for k in fp8) and any("experts.0.gate_proj" in k for k in fp8)
    for key, stored in out.items():
        if key.endswith(hf_fp8.SCALE_SUFFIX):
            continue
        if stored.dtype == torch.float8_e4m3fn:
            want = tf_dequantize(stored, out[hf_fp8.scale_key(key)])
        else:
            want = stored.to(torch.float32)
        target = target_of(key)
        got = target.view(params[target.param])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), key


@pytest.mark.parametrize("to", ["hf", "mxrl"])
def test_convert_keeps_the_correction_bias_fp32(to, tmp_path, capsys):
    """`mxrl convert` (mxrl's quantized checkpoint, or the served HF FP8 one) writes the router
    bias as the fp32 values of the model (the export keeps it fp32, not the bf16 of the plan's
    other unquantized tensors); the served checkpoint loads back through from_pretrained."""
    import glob

    from safetensors import safe_open

    from mxrl.models import save_pretrained

    model = _model()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, DeepseekMoE):
                m.gate.e_score_correction_bias.normal_(0.0, 0.01)
    src = save_pretrained(model, tmp_path / "src", progress=False)
    out = tmp_path / "out"
    argv = ["convert", "--recipe", "fp8-block", "--model", str(src), "--out", str(out), "--to", to]
    assert main(argv) == 0, capsys.readouterr().err
    params = dict(model.named_parameters())
    found = 0
    for file in glob.glob(str(out / "*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if key.endswith("e_score_correction_bias"):
                    assert f.get_tensor(key).dtype == torch.float32
                    assert torch.equal(f.get_tensor(key), params[key].detach())
                    found += 1
    assert found == 3
    if to == "hf":
        back = dict(from_pretrained(out, progress=False).named_parameters())
        for key in params:
            if key.endswith("e_score_correction_bias"):
                assert torch.equal(back[key], params[key].detach())
