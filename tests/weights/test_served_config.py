"""Edges of the served checkpoint's config (mxrl.weights.served_config, served_format) that
tests/weights/test_served.py does not reach: the mutation run's survivors
(docs/mutation/weights.served.md). Expected values are written out from the formats'
definitions: HF fine-grained FP8's `quantization_config` as DeepSeek-V3 and transformers'
FineGrainedFP8Config write it, compressed-tensors' QuantizationArgs of its MXFP8 / NVFP4A16
presets."""

import pytest

import mxrl
from mxrl.weights.served import served_format
from mxrl.weights.served_config import precision_contract, quantization_config
from tests.weights.served_cases import (
    ATTN0,
    ATTN1,
    FP8_L0,
    L0,
    L1,
    MIXED_CT,
    experts,
    model_and_plan,
    recipe,
)

# Not in the capability matrix, as tests/weights/test_served.py: no reduction here depends on the
# CPU capability.


# --- served_format ------------------------------------------------------------------------------


def test_served_format_of_each_family_of_formats():
    cases = {
        "none": recipe(),
        "fp8": FP8_L0,
        "compressed-tensors": MIXED_CT,
    }
    for want, r in cases.items():
        assert str(served_format(model_and_plan(r)[1])) == want
    mx_only = recipe({"match": {"kind": "attention"}, "format": "mxfp8"})
    assert str(served_format(model_and_plan(mx_only)[1])) == "compressed-tensors"


def test_a_quantized_embedding_is_refused():
    r = recipe({"match": {"kind": "embedding"}, "format": "mxfp8"})
    with pytest.raises(ValueError, match=r"embed_tokens.weight \(mxfp8\).*Linear layers only"):
        served_format(model_and_plan(r)[1])


def test_two_fp8_block_sizes_are_refused():
    r = recipe(
        {"match": {"name": "*.q_proj.weight"}, "format": "fp8_block", "block": [32, 32]},
        {"match": {"name": "*.o_proj.weight"}, "format": "fp8_block", "block": [64, 64]},
    )
    with pytest.raises(ValueError, match="weight_block_size is one per checkpoint"):
        served_format(model_and_plan(r)[1])


# --- config.json --------------------------------------------------------------------------------


def test_hf_fp8_quantization_config_is_deepseek_v3s():
    _, plan = model_and_plan(FP8_L0)
    bf16_linears = sorted(
        [f"{L0}.mlp.gate", *ATTN1, f"{L1}.mlp.gate", *experts(L1), "lm_head"]
    )  # the router, the last layer and the head; embeddings and norms are not Linear modules
    assert quantization_config(plan, served_format(plan)) == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "modules_to_not_convert": bf16_linears,
    }
    transformers = pytest.importorskip("transformers")
    qc = transformers.FineGrainedFP8Config.from_dict(quantization_config(plan, served_format(plan)))
    assert qc.weight_block_size in ([32, 32], (32, 32)) and qc.activation_scheme == "dynamic"


# compressed-tensors' QuantizationArgs as its presets define them; `observer` is what a
# calibration tool (llm-compressor) writes: minmax for static weights, none for dynamic inputs
MXFP8_W = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
           "group_size": 32, "block_structure": None, "dynamic": False, "actorder": None,
           "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
           "zp_dtype": "torch.uint8"}  # fmt: skip
MXFP8_A = {**MXFP8_W, "dynamic": True, "observer": None}
NVFP4_W = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
           "group_size": 16, "block_structure": None, "dynamic": False, "actorder": None,
           "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn",
           "zp_dtype": "torch.float8_e4m3fn"}  # fmt: skip


def test_compressed_tensors_config_of_a_mixed_plan():
    _, plan = model_and_plan(MIXED_CT)
    qc = quantization_config(plan, served_format(plan))
    assert qc == {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": sorted(ATTN0 + ATTN1),
                "weights": MXFP8_W,
                "input_activations": MXFP8_A,
                "output_activations": None,
                "format": "mxfp8-quantized",
            },
            "group_1": {
                "targets": sorted(experts(L0) + experts(L1)),
                "weights": NVFP4_W,
                "input_activations": None,
                "output_activations": None,
                "format": "nvfp4-pack-quantized",
            },
        },
        "ignore": sorted([f"{L0}.mlp.gate", f"{L1}.mlp.gate", "lm_head"]),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
        "version": "0.20.1",
    }
    # and compressed-tensors reads those args as its own MXFP8 / NVFP4A16 presets' (all but
    # the observer, which the presets leave to the calibration tool)
    ct = pytest.importorskip("compressed_tensors.quantization")
    config = ct.QuantizationConfig.model_validate(qc)
    presets = {"group_0": "MXFP8", "group_1": "NVFP4A16"}
    for name, preset in presets.items():
        want = ct.preset_name_to_scheme(preset, ["Linear"])
        got = config.config_groups[name]
        for field in ("weights", "input_activations"):
            a, b = getattr(got, field), getattr(want, field)
            assert (a is None) == (b is None), (name, field)
            if a is not None:
                assert a.model_copy(update={"observer": None}) == b, (name, field)


def test_compressed_tensors_config_of_one_format_names_it():
    _, plan = model_and_plan(recipe({"match": {"kind": "attention"}, "format": "mxfp8"}))
    qc = quantization_config(plan, served_format(plan))
    assert qc["format"] == "mxfp8-quantized" and list(qc["config_groups"]) == ["group_0"]
    assert qc["config_groups"]["group_0"]["targets"] == sorted(ATTN0 + ATTN1)


def test_a_bf16_plan_has_no_quantization_config():
    _, plan = model_and_plan(recipe())
    assert quantization_config(plan, served_format(plan)) is None


def test_precision_contract_states_the_activations_of_every_nvfp4_tensor():
    _, plan = model_and_plan(
        MIXED_CT,
    )
    contract = precision_contract(plan)
    note = contract["nvfp4_activations"].pop("note")
    assert "per token" in note and "input_global_scale" in note
    assert contract == {
        "mxrl_version": mxrl.__version__,
        "recipe": "edge",
        "plan_hash": plan.hash(),
        "formats": ["mxfp8", "nvfp4"],
        "nvfp4_activations": {"global_scale": ["per_tensor", "per_token"]},
    }
    _, fp8 = model_and_plan(FP8_L0)
    assert precision_contract(fp8) == {
        "mxrl_version": mxrl.__version__,
        "recipe": "edge",
        "plan_hash": fp8.hash(),
        "formats": ["fp8_block"],
    }


def test_precision_contract_says_the_fp8_kv_cache_has_no_served_equivalent():
    _, plan = model_and_plan({**FP8_L0, "kv_cache": "fp8"})
    contract = precision_contract(plan)
    note = contract["kv_cache"].pop("note")
    assert "per KV head" in note and "k_scale" in note
    assert contract == {
        "mxrl_version": mxrl.__version__,
        "recipe": "edge",
        "plan_hash": plan.hash(),
        "formats": ["fp8_block"],
        "kv_cache": {"format": "fp8"},
    }
