"""A record against the plan: the stored layout of every format (hand-computed from the format
tables of docs/formats.md, and what the quantizers really write), the layout a TensorSpec
implies, and `check_record` / `check_global_scales` refusing what is not that."""

import dataclasses

import pytest
import torch

from mxrl.formats import quantize, stored_layout
from mxrl.recipe import resolve
from mxrl.recipe.quantize import weight_global_scale, weight_layout
from mxrl.weights import WeightRecord, check_global_scales, check_record, export_weights
from tests.sync.helpers import MIXED, tiny

U8, E8M0, E4M3, F32 = torch.uint8, torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.float32

# (format, shape, options, quantize() options, the fields' (dtype, shape) worked out by hand)
LAYOUTS = [
    ("mxfp8", (64, 96), {}, {}, {"qdata": (U8, (64, 96)), "scale": (E8M0, (64, 3))}),
    ("mxfp8", (64, 96), {"axis": 0}, {"axis": 0},
     {"qdata": (U8, (64, 96)), "scale": (E8M0, (2, 96))}),
    ("mxfp8", (4, 32, 64), {}, {}, {"qdata": (U8, (4, 32, 64)), "scale": (E8M0, (4, 32, 2))}),
    ("nvfp4", (64, 96), {}, {},
     {"qdata": (U8, (64, 48)), "scale": (E4M3, (64, 6)), "global_scale": (F32, ())}),
    ("nvfp4", (64, 96), {"global_scale": "row"}, {"per_token": True},
     {"qdata": (U8, (64, 48)), "scale": (E4M3, (64, 6)), "global_scale": (F32, (64, 1))}),
    ("nvfp4", (4, 32, 64), {"global_scale": "matrix"}, {"global_amax": torch.full((4, 1, 1), 8.0)},
     {"qdata": (U8, (4, 32, 32)), "scale": (E4M3, (4, 32, 4)), "global_scale": (F32, (4, 1, 1))}),
    ("nvfp4", (4, 32, 64), {"global_scale": "row"}, {"global_amax": torch.full((4, 32, 1), 8.0)},
     {"qdata": (U8, (4, 32, 32)), "scale": (E4M3, (4, 32, 4)), "global_scale": (F32, (4, 32, 1))}),
    ("fp8_block", (256, 384), {}, {}, {"qdata": (U8, (256, 384)), "scale": (F32, (2, 3))}),
    ("fp8_block", (100, 64), {"block": (32, 32)}, {"block": (32, 32)},  # a partial row block
     {"qdata": (U8, (100, 64)), "scale": (F32, (4, 2))}),
    ("fp8_block", (4, 64, 32), {"block": (32, 32)}, {"block": (32, 32)},
     {"qdata": (U8, (4, 64, 32)), "scale": (F32, (4, 2, 1))}),
    ("fp8_block", (8, 256), {"block": (1, 128)}, {"block": (1, 128)},
     {"qdata": (U8, (8, 256)), "scale": (F32, (8, 2))}),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "shape", "options", "qoptions", "want"), LAYOUTS)
def test_stored_layout_is_what_the_quantizers_write(fmt, shape, options, qoptions, want):
    assert stored_layout(fmt, shape, **options) == want
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    assert quantize(x, fmt, **qoptions).layout() == want


def test_stored_layout_refuses_what_a_format_cannot_block():
    with pytest.raises(ValueError, match="multiple of 32"):
        stored_layout("mxfp8", (64, 48))
    with pytest.raises(ValueError, match="only mxfp8"):
        stored_layout("nvfp4", (64, 64), axis=0)
    with pytest.raises(ValueError, match="global_scale must be one of"):
        stored_layout("nvfp4", (64, 64), global_scale="token")
    with pytest.raises(ValueError, match="does not tile"):
        stored_layout("fp8_block", (64, 96), block=(64, 64))


def mixed_plan():
    model = tiny()
    return model, resolve(MIXED, {n: p.shape for n, p in model.named_parameters()})


def test_a_spec_gives_its_weights_layout():
    """Per-tensor for 2-D NVFP4 weights (a fuse pair too), per expert for 3-D ones, per half for
    a fused gate_up without a fuse group; the export writes exactly these layouts."""
    model, plan = mixed_plan()
    granularity = {
        "model.layers.0.mlp.shared_expert.gate_proj.weight": "tensor",
        "model.layers.0.mlp.shared_expert.down_proj.weight": "tensor",
        "model.layers.0.mlp.experts.gate_up_proj": "matrix",
        "model.layers.0.mlp.experts.down_proj": "matrix",
        "model.layers.2.mlp.experts.gate_up_proj": "row",
        "model.layers.2.mlp.experts.down_proj": "matrix",
    }
    for name, want in granularity.items():
        assert weight_global_scale(plan[name]) == want, name
    assert weight_layout(plan["model.layers.2.mlp.experts.gate_up_proj"]) == {
        "qdata": (U8, (8, 64, 32)),
        "scale": (E4M3, (8, 64, 4)),
        "global_scale": (F32, (8, 64, 1)),
    }
    assert weight_layout(plan["model.layers.0.self_attn.o_proj.weight"]) == {
        "qdata": (U8, (64, 64)),
        "scale": (F32, (2, 2)),
    }
    records = list(export_weights(model.named_parameters(), plan))
    for record in records:
        check_record(record, plan[record.name], torch.bfloat16)
    check_global_scales(records, plan)


def test_check_record_names_the_tensor_what_the_plan_says_and_what_came():
    model, plan = mixed_plan()
    records = {r.name: r for r in export_weights(model.named_parameters(), plan)}
    q = "model.layers.0.self_attn.q_proj.weight"
    plain = WeightRecord(q, torch.zeros(64, 64, dtype=torch.bfloat16), "")
    with pytest.raises(ValueError, match=r"q_proj\.weight: the plan stores mxfp8 \(64, 64\) "
                       r"row-wise, got a plain bfloat16 \(64, 64\) tensor"):  # fmt: skip
        check_record(plain, plan[q])
    other = dataclasses.replace(records[q], value=quantize(torch.ones(64, 64), "nvfp4"))
    with pytest.raises(ValueError, match=r"got a nvfp4 QTensor of shape \(64, 64\)"):
        check_record(other, plan[q])
    router = "model.layers.0.mlp.gate.weight"
    fp32 = dataclasses.replace(records[router], value=records[router].value.float())
    check_record(fp32, plan[router])  # no plain dtype asked: any floating dtype
    with pytest.raises(ValueError, match=r"of torch\.bfloat16 \(export with bf16_dtype"):
        check_record(fp32, plan[router], torch.bfloat16)
    ints = dataclasses.replace(records[router], value=torch.zeros(8, 64, dtype=torch.int16))
    with pytest.raises(ValueError, match="got int16"):
        check_record(ints, plan[router])


def test_check_global_scales_refuses_each_unusable_value():
    model, plan = mixed_plan()
    records = {r.name: r for r in export_weights(model.named_parameters(), plan)}
    name = "model.layers.0.mlp.experts.gate_up_proj"
    for value, shown in [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf"),
                         (0.0, "0.0"), (-1.0, "-1.0")]:  # fmt: skip
        gs = records[name].value.global_scale.clone()
        gs[5, 0, 0] = value
        bad = dataclasses.replace(records[name], value=dataclasses.replace(
            records[name].value, global_scale=gs))  # fmt: skip
        with pytest.raises(ValueError, match=f"{name}: global_scale must be finite and positive"
                           rf".*got {shown} at index \(5, 0, 0\)"):  # fmt: skip
            check_global_scales([*records.values(), bad], plan)
    gate = "model.layers.1.mlp.shared_expert.gate_proj.weight"
    up = gate.replace("gate_proj", "up_proj")
    v = records[up].value
    unshared = dataclasses.replace(records[up], value=dataclasses.replace(
        v, global_scale=v.global_scale * 0.5))  # fmt: skip
    with pytest.raises(ValueError, match=f"{gate} and {up}: gate and up share one"):
        check_global_scales([records[gate], unshared], plan)
    check_global_scales([records[gate]], plan)  # a partial update: no pair to compare


def test_the_layout_kept_per_spec_is_each_specs_own():
    """`spec_layout` (what check_record and the export compare against) derives a spec's
    layout once: a spec of another plan (another shape, format or block) is another key."""
    from mxrl.weights.export import spec_layout

    _, plan = mixed_plan()
    specs = [s for s in plan.values() if s.format.value != "bf16"]
    others = [dataclasses.replace(s, shape=(s.shape[0] * 2, *s.shape[1:])) for s in specs]
    for spec in specs + others + specs:
        assert spec_layout(spec) == weight_layout(spec)
    assert all(spec_layout(a) != spec_layout(b) for a, b in zip(specs, others, strict=True))
