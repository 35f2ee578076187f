"""Served checkpoints (`mxrl convert --to hf`): what transformers / compressed-tensors read back is
mxrl's dequantization bit for bit, and the files hold the rollout engine's bytes.

The clients are the real ones: transformers' `from_pretrained` (its fine-grained FP8 and
compressed-tensors integrations, dequantizing on the CPU) and compressed-tensors' own
decompressors where transformers 5 cannot read a layout (MoE experts in compressed-tensors:
docs/checkpoints.md says why)."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from mxrl.arch import ModelConfig
from mxrl.cli import main
from mxrl.engine import Engine, SamplingParams
from mxrl.formats import QTensor
from mxrl.models import build_model, save_pretrained
from mxrl.recipe import resolve
from mxrl.weights import convert_checkpoint, export
from mxrl.weights.served import (
    served_format,
    served_tensors,
    write_served_checkpoint,
)
from tests.sync.helpers import MIXED

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
pytest.importorskip("accelerate")  # transformers' quantizers need it to load

# Not in the capability matrix: the clients dequantize with one IEEE multiply per element (no
# reduction whose order a CPU capability could change), and the quantizer that made the bytes
# has its own capability tests (tests/formats, tests/kernels).

# 128-multiples: HF fine-grained FP8 takes 128x128 blocks (its CPU dequantization derives the
# block from the scale grid, so a partial block would be misread by the client, not by mxrl)
_BASE = {
    "vocab_size": 256,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
MOE = {
    **_BASE,
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
}
DENSE = {**_BASE, "model_type": "qwen3"}
# every Linear of a dense model in one format (the presets quantize routed experts only)
ALL_LINEAR = {
    "backward": "high_precision",
    "default": "bf16",
    "rules": [
        {"match": {"layers": "last 15%"}, "format": "bf16"},
        {"match": {"kind": ["attention", "dense_mlp"]}},
    ],
}


def recipe_all(fmt: str) -> dict:
    extra = {"activations": "per_token"} if fmt == "nvfp4" else {}
    rules = [dict(ALL_LINEAR["rules"][0]), {**ALL_LINEAR["rules"][1], "format": fmt, **extra}]
    return {**ALL_LINEAR, "name": f"all-linear-{fmt}", "rules": rules}


def make(config: dict, recipe, seed: int = 0):
    model = build_model(ModelConfig.from_hf(config), dtype=torch.float32, seed=seed)
    plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
    return model, plan


def write(tmp_path, config, recipe, name="served"):
    model, plan = make(config, recipe)
    out = write_served_checkpoint(
        export(model, plan), plan, model.config.to_hf(dtype="float32"), tmp_path / name
    )
    return model, plan, out


def mxrl_dequantized(model, plan) -> dict[str, torch.Tensor]:
    out = {}
    for r in export(model, plan).records():
        out[r.name] = r.value.dequantize() if isinstance(r.value, QTensor) else r.value
    return out


def file_tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118
    return out


def hf_load(path):
    qc = json.loads((path / "config.json").read_text()).get("quantization_config", {})
    kwargs = {}
    if qc.get("quant_method") == "compressed-tensors":
        # decompress every Linear (run_compressed keeps them packed, as a GPU server would)
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(run_compressed=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    return dict(model.named_parameters())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# --- transformers reads them ------------------------------------------------------------------


def test_fp8_block_moe_loads_in_transformers_as_mxrl_dequantizes(tmp_path):
    model, plan, out = write(tmp_path, MOE, "fp8-block")
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert "model.layers.1.mlp.experts" in qc["modules_to_not_convert"]  # last 15%: bf16
    assert "model.layers.0.self_attn.q_proj" not in qc["modules_to_not_convert"]
    loaded = hf_load(out)
    want = mxrl_dequantized(model, plan)
    assert set(loaded) == set(want)
    quantized = 0
    for name, w in want.items():
        spec = plan[name]
        got = loaded[name]
        # fp8 x fp32 scale is exact in fp32: transformers' (q * s) equals mxrl's bit for bit
        expect = w.to(torch.float32) if spec.format.value == "fp8_block" else w
        assert torch.equal(bits(got.to(expect.dtype)), bits(expect)), name
        quantized += spec.format.value == "fp8_block"
    assert quantized == 6  # layer 0: q, k, v, o, experts gate_up, down (layer 1: last 15%)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_compressed_tensors_dense_loads_in_transformers_as_mxrl_dequantizes(tmp_path, fmt):
    model, plan, out = write(tmp_path, DENSE, recipe_all(fmt))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == {"mxfp8": "mxfp8-quantized", "nvfp4": "nvfp4-pack-quantized"}[fmt]
    loaded = hf_load(out)
    want = mxrl_dequantized(model, plan)
    num_quantized = 0
    for name, w in want.items():
        got = loaded[name]
        if plan[name].format.value == fmt:
            # compressed-tensors decompresses in bf16: E4M3 x 2^k (MXFP8) is exact there; for
            # NVFP4 mxrl's fp32 value rounds to the same bf16
            num_quantized += 1
            assert got.dtype == torch.bfloat16 or torch.equal(got, got.bfloat16().float())
            assert torch.equal(bits(got.bfloat16()), bits(w.bfloat16())), name
        else:
            assert torch.equal(got, w.float()), name
    assert num_quantized == 7  # layer 0's q, k, v, o, gate, up, down; layer 1 is bf16


# --- compressed-tensors reads the MoE experts -------------------------------------------------


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4-hp"])
def test_compressed_tensors_moe_experts_decompress_as_mxrl_dequantizes(tmp_path, preset):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    model, plan, out = write(tmp_path, MOE, preset)
    qc = QuantizationConfig.model_validate(
        json.loads((out / "config.json").read_text())["quantization_config"]
    )
    (group,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(group.format)
    files = file_tensors(out)
    want = mxrl_dequantized(model, plan)
    checked = 0
    for e in range(MOE["num_experts"]):
        gate_up = want["model.layers.0.mlp.experts.gate_up_proj"][e]
        inter = gate_up.shape[0] // 2
        parts = {
            "gate_proj": gate_up[:inter],
            "up_proj": gate_up[inter:],
            "down_proj": want["model.layers.0.mlp.experts.down_proj"][e],
        }
        for part, expect in parts.items():
            module = f"model.layers.0.mlp.experts.{e}.{part}"
            assert module in group.targets and module not in qc.ignore
            state = {
                k.removeprefix(module + "."): v
                for k, v in files.items()
                if k.startswith(module + ".")
            }
            dense = compressor.decompress(state, group)["weight"]
            assert torch.equal(bits(dense.bfloat16()), bits(expect.bfloat16())), module
            checked += 1
    assert checked == 12
    # the last layer's experts stay bf16 and are in the ignore list, every expert named
    assert "model.layers.1.mlp.experts" in qc.ignore
    assert "model.layers.1.mlp.experts.3.down_proj" in qc.ignore
    assert files["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.bfloat16


# --- the engine's bytes -----------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["fp8-block", "mxfp8", "nvfp4-hp"])
def test_files_hold_the_bytes_the_engine_rolled_out(tmp_path, preset):
    model, plan, out = write(tmp_path, MOE, preset)
    engine = Engine(model, plan, weight_dtype=torch.bfloat16)
    engine.generate(
        [[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=2)
    )  # the engine has rolled out with them
    files = file_tensors(out)
    expected: dict[str, torch.Tensor] = {}
    for record in engine.records():
        expected.update(served_tensors(record.name, record.value))
    assert set(files) == set(expected)
    for key, t in expected.items():
        assert files[key].dtype == t.dtype, key
        assert torch.equal(bits(files[key]), bits(t)), key
    # and those are the engine's QTensor fields, not a re-quantization
    q = engine.weights["model.layers.0.mlp.experts.gate_up_proj"]
    inter = q.shape[1] // 2
    if q.fmt.value == "nvfp4":
        got = files["model.layers.0.mlp.experts.2.up_proj.weight_packed"]
        assert torch.equal(got, q.qdata[2, inter:])
        gs = files["model.layers.0.mlp.experts.2.up_proj.weight_global_scale"]
        assert bits(gs).tolist() == bits(q.global_scale[2].reshape(-1)[:1]).tolist()
    else:
        got = files["model.layers.0.mlp.experts.2.up_proj.weight"]
        assert torch.equal(bits(got), q.qdata[2, inter:])
    gate = files[
        f"model.layers.0.mlp.experts.2.gate_proj.weight{'_packed' * (q.fmt.value == 'nvfp4')}"
    ]
    assert torch.equal(bits(gate), q.qdata[2, :inter])


def test_config_tokenizer_and_contract_travel(tmp_path):
    src = tmp_path / "hf"
    model = build_model(ModelConfig.from_hf(MOE), dtype=torch.float32, seed=0)
    save_pretrained(model, src)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
    out = convert_checkpoint(src, "nvfp4-hp", tmp_path / "served", to="hf")
    config = json.loads((out / "config.json").read_text())
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 256}\n'
    assert config["num_experts"] == 4 and config["model_type"] == "qwen3_moe"
    plan = resolve("nvfp4-hp", {n: p.shape for n, p in model.named_parameters()})
    assert config["mxrl"]["plan_hash"] == plan.hash()
    assert config["mxrl"]["nvfp4_activations"]["global_scale"] == ["per_token"]
    group = config["quantization_config"]["config_groups"]["group_0"]
    assert group["input_activations"] is None  # per-token scales: no field states them
    assert config["torch_dtype"] == "bfloat16"


# --- refusals ---------------------------------------------------------------------------------


def test_a_plan_mixing_fp8_block_and_mx_formats_is_refused_naming_tensors(tmp_path):
    from tests.sync.helpers import tiny

    model = tiny(seed=0)
    plan = resolve(MIXED, {n: p.shape for n, p in model.named_parameters()})
    with pytest.raises(ValueError, match=r"o_proj.weight is fp8_block .*\(compressed-tensors\)"):
        served_format(plan)
    with pytest.raises(ValueError, match="fp8_block"):
        write_served_checkpoint([], plan, {}, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_a_quantized_lm_head_is_refused(tmp_path):
    recipe = {
        "name": "head",
        "default": "bf16",
        "rules": [{"match": {"kind": "lm_head"}, "format": "mxfp8"}],
    }
    _, plan = make(DENSE, recipe)
    with pytest.raises(ValueError, match=r"lm_head.weight \(mxfp8\).*Linear layers only"):
        served_format(plan)


def test_experts_of_one_layer_in_two_formats_are_refused():
    recipe = {
        "name": "split",
        "default": "bf16",
        "rules": [{"match": {"name": "*.mlp.experts.down_proj"}, "format": "mxfp8"}],
    }
    _, plan = make(MOE, recipe)
    with pytest.raises(ValueError, match=r"serving engines quantize a layer's experts as one"):
        served_format(plan)


def test_cli_refusal_writes_nothing_and_keeps_what_was_there(tmp_path, capsys):
    from tests.sync.helpers import tiny

    src = tmp_path / "hf"
    save_pretrained(tiny(seed=0), src)
    recipe = tmp_path / "mixed.yaml"
    recipe.write_text(json.dumps(MIXED))
    out = tmp_path / "out"
    code = main(
        ["convert", "--recipe", str(recipe), "--model", str(src), "--out", str(out), "--to", "hf"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("mxrl: error:") and "o_proj.weight is fp8_block" in err
    assert not out.exists()
    # an existing export is not touched by a refused --overwrite
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code = main(
        ["convert", "--recipe", str(recipe), "--model", str(src), "--out", str(out), "--to", "hf",
         "--overwrite"]
    )  # fmt: skip
    assert code == 2 and [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_cli_writes_a_served_checkpoint(tmp_path, capsys):
    src = tmp_path / "hf"
    save_pretrained(build_model(ModelConfig.from_hf(MOE), dtype=torch.float32, seed=1), src)
    out = tmp_path / "served"
    code = main(
        ["convert", "--recipe", "fp8-block", "--model", str(src), "--out", str(out), "--to", "hf"]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    assert "quantization_config: fp8" in text and "(served checkpoint)" in text
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    shutil.rmtree(out)


def test_the_folder_gets_the_permissions_of_any_new_file(tmp_path):
    """mkdtemp makes its folder 0700 and safetensors its files 0600: a served checkpoint (read
    by a serving job, often as another user) takes the process's umask like any new file."""
    import os

    _, _, out = write(tmp_path, DENSE, recipe_all("mxfp8"))
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    for f in out.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f.name
