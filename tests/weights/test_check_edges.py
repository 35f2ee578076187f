"""Edges of the checks against the plan (mxrl/weights/check.py), for the mutation run (issue 33,
docs/mutation/weights.check.md): each refusal's whole message, written out here from the
module's wording and the plan's layouts worked out by hand (the tiny MoE under the MIXED recipe
of tests/sync/helpers.py), what is accepted at each boundary, and `check_config` called directly
on the tiny MoE's config.json and edited copies of it."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from mxrl.arch import builtin_config
from mxrl.formats import quantize
from mxrl.recipe import resolve
from mxrl.weights import WeightRecord, check_global_scales, check_record, export_weights
from mxrl.weights.check import check_config
from tests.sync.helpers import MIXED, tiny

# built at import (collection): the plan and records every test reads
MODEL = tiny()
SHAPES = {n: tuple(p.shape) for n, p in MODEL.named_parameters()}
PLAN = resolve(MIXED, SHAPES)
RECORDS = {r.name: r for r in export_weights(MODEL.named_parameters(), PLAN)}

Q = "model.layers.0.self_attn.q_proj.weight"  # mxfp8 (64, 64)
O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # fp8_block (64, 64) in 32x32 blocks
GATE = "model.layers.0.mlp.shared_expert.gate_proj.weight"  # nvfp4 per tensor, fuse pair
UP = "model.layers.0.mlp.shared_expert.up_proj.weight"
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"  # nvfp4 (8, 64, 64) per expert
HALVES = "model.layers.2.mlp.experts.gate_up_proj"  # nvfp4 (8, 64, 64) per half
NORM = "model.layers.0.input_layernorm.weight"  # bf16 (64,)
ROUTER = "model.layers.0.mlp.gate.weight"  # bf16 (8, 64)


def with_value(name, value):
    return dataclasses.replace(RECORDS[name], value=value)


def refused(record, message, plain_dtype=None, spec=None):
    with pytest.raises(ValueError) as e:
        check_record(record, spec or PLAN[record.name], plain_dtype)
    assert str(e.value) == message


def test_the_plan_is_the_one_worked_out_here():
    assert (PLAN[Q].format.value, PLAN[Q].shape) == ("mxfp8", (64, 64))
    assert (PLAN[O_PROJ].format.value, PLAN[O_PROJ].block) == ("fp8_block", (32, 32))
    assert PLAN[GATE].fuse_group == PLAN[UP].fuse_group is not None
    assert PLAN[EXPERTS].shape == PLAN[HALVES].shape == (8, 64, 64)
    for record in RECORDS.values():  # the export is what the plan stores
        check_record(record, PLAN[record.name], torch.bfloat16)


def test_a_plain_tensor_for_a_quantized_spec_and_the_reverse():
    refused(
        with_value(Q, torch.zeros(64, 64, dtype=torch.float32)),
        f"{Q}: the plan stores mxfp8 (64, 64) row-wise, got a plain float32 (64, 64) tensor",
    )
    refused(
        with_value(NORM, quantize(torch.ones(1, 64), "mxfp8")),
        f"{NORM}: the plan stores a plain (64,) tensor, got a mxfp8 QTensor of shape (1, 64)",
    )


def test_a_quantized_value_of_another_format_or_shape():
    refused(
        with_value(Q, quantize(torch.ones(32, 64), "mxfp8")),
        f"{Q}: the plan stores mxfp8 (64, 64) row-wise, got a mxfp8 QTensor of shape (32, 64)",
    )
    refused(
        with_value(O_PROJ, quantize(torch.ones(64, 64), "mxfp8")),
        f"{O_PROJ}: the plan stores fp8_block (64, 64) row-wise, (32, 32) blocks, got a mxfp8 "
        "QTensor of shape (64, 64)",
    )
    refused(
        with_value(EXPERTS, quantize(torch.ones(8, 64, 64), "mxfp8")),
        f"{EXPERTS}: the plan stores nvfp4 (8, 64, 64) row-wise, one global scale per expert, "
        "got a mxfp8 QTensor of shape (8, 64, 64)",
    )
    refused(
        with_value(HALVES, quantize(torch.ones(8, 64, 64), "mxfp8")),
        f"{HALVES}: the plan stores nvfp4 (8, 64, 64) row-wise, one global scale per row (one "
        "per gate/up half), got a mxfp8 QTensor of shape (8, 64, 64)",
    )
    refused(
        with_value(GATE, quantize(torch.ones(64, 64), "mxfp8")),
        f"{GATE}: the plan stores nvfp4 (64, 64) row-wise, one global scale per tensor, got a "
        "mxfp8 QTensor of shape (64, 64)",
    )


def test_a_column_wise_copy_is_refused():
    refused(
        with_value(Q, quantize(torch.ones(64, 64), "mxfp8", axis=0)),
        f"{Q}: the plan stores mxfp8 (64, 64) row-wise, got a column-wise copy (blocks along "
        "dim 0); send the row-wise quantization",
    )


def test_each_field_is_held_to_the_plans_layout():
    q = RECORDS[EXPERTS].value
    scalar = dataclasses.replace(q, global_scale=q.global_scale.reshape(-1)[0].clone())
    refused(
        with_value(EXPERTS, scalar),
        f"{EXPERTS}: global_scale must be float32 (8, 1, 1) for nvfp4 (8, 64, 64) row-wise, one "
        "global scale per expert, got float32 ()",
    )
    blocks = quantize(torch.ones(64, 64), "fp8_block", block=(64, 64))  # scale [1, 1]
    refused(
        with_value(O_PROJ, blocks),
        f"{O_PROJ}: scale must be float32 (2, 2) for fp8_block (64, 64) row-wise, (32, 32) blocks, "
        "got float32 (1, 1)",
    )
    per_tensor = quantize(torch.ones(8, 64, 64), "nvfp4")  # global_scale [] for a per-half spec
    refused(
        with_value(HALVES, per_tensor),
        f"{HALVES}: global_scale must be float32 (8, 64, 1) for nvfp4 (8, 64, 64) row-wise, one "
        "global scale per row (one per gate/up half), got float32 ()",
    )


def test_a_plain_tensor_is_held_to_its_shape_and_dtype():
    refused(
        with_value(NORM, torch.ones(32, dtype=torch.bfloat16)),
        f"{NORM}: the plan stores a plain (64,) tensor of torch.bfloat16 (export with "
        "bf16_dtype=torch.bfloat16), got bfloat16 (32,)",
        torch.bfloat16,
    )
    refused(
        with_value(NORM, torch.ones(32)),
        f"{NORM}: the plan stores a plain (64,) tensor, got float32 (32,)",
    )
    refused(
        with_value(ROUTER, torch.zeros(8, 64, dtype=torch.int32)),
        f"{ROUTER}: the plan stores a plain (8, 64) tensor, got int32 (8, 64)",
    )
    refused(
        with_value(ROUTER, torch.zeros(8, 64, dtype=torch.float16)),
        f"{ROUTER}: the plan stores a plain (8, 64) tensor of torch.bfloat16 (export with "
        "bf16_dtype=torch.bfloat16), got float16 (8, 64)",
        torch.bfloat16,
    )
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):  # any float
        check_record(with_value(ROUTER, torch.zeros(8, 64, dtype=dtype)), PLAN[ROUTER])
    check_record(with_value(ROUTER, torch.zeros(8, 64)), PLAN[ROUTER], torch.float32)


def test_a_tensor_that_keeps_fp32_is_fp32_whatever_the_plain_dtype():
    """DeepSeek's e_score_correction_bias stays fp32 (mxrl.arch.names.FP32_SUFFIXES)."""
    name = "model.layers.0.mlp.gate.e_score_correction_bias"
    spec = dataclasses.replace(PLAN[NORM], name=name, shape=(8,))
    fp32 = WeightRecord(name, torch.zeros(8), "")
    check_record(fp32, spec, torch.bfloat16)
    check_record(fp32, spec)
    bf16 = WeightRecord(name, torch.zeros(8, dtype=torch.bfloat16), "")
    check_record(bf16, spec)  # no plain dtype asked: any floating dtype
    refused(
        bf16,
        f"{name}: the plan stores a plain (8,) tensor of torch.float32 (export with "
        "bf16_dtype=torch.float32), got bfloat16 (8,)",
        torch.bfloat16,
        spec,
    )


def scaled(name, gs):
    return with_value(name, dataclasses.replace(RECORDS[name].value, global_scale=gs))


def global_scales_refused(records, message):
    with pytest.raises(ValueError) as e:
        check_global_scales(records, PLAN)
    assert re.fullmatch(message, str(e.value)), str(e.value)


def test_the_first_bad_global_scale_is_named_with_its_first_bad_index():
    gs = RECORDS[EXPERTS].value.global_scale.clone()
    gs[6, 0, 0], gs[2, 0, 0] = 0.0, -3.0
    global_scales_refused(
        [*RECORDS.values(), scaled(EXPERTS, gs)],
        re.escape(
            f"{EXPERTS}: global_scale must be finite and positive (an NVFP4 encode scale "
            "2688/amax) for nvfp4 (8, 64, 64) row-wise, one global scale per expert, got -3.0 "
            "at index (2, 0, 0)"
        ),
    )
    zero_d = torch.tensor(float("nan"))  # a per-tensor scale: index ()
    global_scales_refused(
        [RECORDS[O_PROJ], scaled(GATE, zero_d), scaled(EXPERTS, gs)],  # GATE comes first
        re.escape(f"{GATE}: global_scale must be finite and positive")
        + r".*one global scale per tensor, got nan at index \(\)",
    )


def test_a_fuse_pair_is_named_gate_then_up():
    gs = RECORDS[UP].value.global_scale * 2
    message = re.escape(
        f"{GATE} and {UP}: gate and up share one NVFP4 global scale (fuse group "
        f"{PLAN[GATE].fuse_group}), got {float(RECORDS[GATE].value.global_scale)} and "
        f"{float(gs)}"
    )
    global_scales_refused([RECORDS[GATE], scaled(UP, gs)], message)
    global_scales_refused([scaled(UP, gs), RECORDS[GATE]], message)  # in either record order


def test_global_scales_that_pass():
    check_global_scales(list(RECORDS.values()), PLAN)
    check_global_scales([], PLAN)
    check_global_scales([RECORDS[Q], RECORDS[NORM]], PLAN)  # no NVFP4 record
    tiny_scale = torch.tensor(1e-30)  # positive however small
    check_global_scales(
        [scaled(GATE, tiny_scale), scaled(UP, tiny_scale.clone())], PLAN
    )  # equal values in two tensors


# --- check_config -------------------------------------------------------------------------

FILE = Path("/ckpt/config.json")
CONFIG = builtin_config("tiny-moe")
FIX = "copy the checkpoint's config.json again, or re-run mxrl convert"


def config_refused(message, **fields):
    with pytest.raises(ValueError) as e:
        check_config(FILE, {**CONFIG, **fields}, PLAN)
    assert str(e.value) == message


def test_the_tiny_config_passes():
    check_config(FILE, dict(CONFIG), PLAN)


def test_a_layer_count_is_refused_before_the_tensors():
    config_refused(
        f"{FILE}: num_hidden_layers is 3, but the plan was resolved for a model of 4 layers; {FIX}",
        num_hidden_layers=3,
    )


def test_a_missing_or_extra_tensor_names_the_field_and_the_tensors():
    config_refused(
        f"{FILE}: field tie_word_embeddings describes a model without the plan's "
        f"['lm_head.weight']; {FIX}",
        tie_word_embeddings=True,
    )
    tied = {n: s for n, s in SHAPES.items() if n != "lm_head.weight"}
    with pytest.raises(ValueError) as e:
        check_config(FILE, dict(CONFIG), resolve(MIXED, tied))
    assert str(e.value) == (
        f"{FILE}: field tie_word_embeddings describes a model with tensor(s) "
        f"['lm_head.weight'] the plan lacks; {FIX}"
    )


def test_a_shape_names_every_field_that_would_fit():
    config_refused(
        f"{FILE}: field hidden_size gives model.embed_tokens.weight the shape (64, 96), but the "
        f"plan holds it as (64, 64); {FIX}",
        hidden_size=96,
    )
    config_refused(
        f"{FILE}: field vocab_size gives model.embed_tokens.weight the shape (128, 64), but the "
        f"plan holds it as (64, 64); {FIX}",
        vocab_size=128,
    )


def test_a_config_that_builds_no_model_is_refused_naming_the_file():
    with pytest.raises(ValueError, match="^" + re.escape(f"{FILE}: ")):
        check_config(FILE, {**CONFIG, "model_type": "llama"}, PLAN)


def test_fields_that_each_would_fit_are_all_named_in_config_order():
    """num_key_value_heads 1 (the plan's 2) gives k_proj (16, 64) for (32, 64): 1 scaled by
    32/16 is 2, and head_dim 16 scaled by 32/16 is 32 (k_proj 1 x 32): both would fit."""
    k = "model.layers.0.self_attn.k_proj.weight"
    config_refused(
        f"{FILE}: field num_key_value_heads or head_dim gives {k} the shape (16, 64), but the "
        f"plan holds it as (32, 64); {FIX}",
        num_key_value_heads=1,
    )


def test_a_try_that_builds_no_model_does_not_stop_the_search():
    """num_key_value_heads 4 gives k_proj (64, 64) for (32, 64): halving num_attention_heads
    (4 -> 2, fewer heads than key/value heads) builds no model and is skipped; halving
    num_key_value_heads or head_dim, later in the config, would fit."""
    k = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(ValueError):
        check_config(FILE, {**CONFIG, "num_attention_heads": 2, "num_key_value_heads": 4}, PLAN)
    config_refused(
        f"{FILE}: field num_key_value_heads or head_dim gives {k} the shape (64, 64), but the "
        f"plan holds it as (32, 64); {FIX}",
        num_key_value_heads=4,
    )


def test_no_one_field_fits_two_edited_dims():
    config_refused(
        f"{FILE}: a field gives model.embed_tokens.weight the shape (96, 96), but the plan holds "
        f"it as (64, 64); {FIX}",
        hidden_size=96,
        vocab_size=96,
    )


def test_a_fuse_pair_of_scales_below_one_is_named_as_a_pair():
    """Scales in (0, 1] are usable (2688/amax for amax >= 2688): unequal ones in a fuse pair
    are refused as a pair, not as unusable values."""
    gate, up = scaled(GATE, torch.tensor(0.5)), scaled(UP, torch.tensor(0.25))
    global_scales_refused(
        [gate, up],
        re.escape(
            f"{GATE} and {UP}: gate and up share one NVFP4 global scale (fuse group "
            f"{PLAN[GATE].fuse_group}), got 0.5 and 0.25"
        ),
    )


@pytest.mark.gpu
def test_global_scales_on_two_devices_are_checked_per_device():
    """An update split between the CPU and the GPU, each fuse pair across the two (gate on the
    CPU and up on the GPU in layer 0, the reverse in layer 1): accepted, and an unequal pair
    still refused by name."""
    gate1, up1 = GATE.replace("layers.0", "layers.1"), UP.replace("layers.0", "layers.1")
    on_gpu = {UP, gate1, EXPERTS}
    records = [
        with_value(r.name, r.value.to("cuda")) if r.name in on_gpu else r for r in RECORDS.values()
    ]
    check_global_scales(records, PLAN)
    v = RECORDS[UP].value
    unequal = with_value(UP, dataclasses.replace(v, global_scale=v.global_scale * 2).to("cuda"))
    with pytest.raises(ValueError, match=re.escape(f"{GATE} and {UP}: gate and up share one")):
        check_global_scales([r if r.name != UP else unequal for r in records], PLAN)
    assert PLAN[gate1].fuse_group == PLAN[up1].fuse_group is not None
