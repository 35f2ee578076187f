"""The refusals and the options of mxrl/parallel/export.py inside one process (as
test_export_edges.py): a non-finite weight in one rank's shard, weights that are not the plan's,
the bf16 dtype, the quantizer's backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mxrl.kernels import Backend, Kernels
from mxrl.parallel import export as sharded
from mxrl.recipe import resolve
from mxrl.weights import export_weights
from tests.parallel.export_cases import (
    PLAN,
    RECIPE,
    SHAPES,
    K,
    Q,
    assert_same_bytes,
    exported,
    masters,
    on_ranks,
)
from tests.parallel.fake_ranks import GROUP, REPLICATED, shard_all


def refusals(fake, whole):
    def body(rank):
        with pytest.raises(ValueError) as e:
            sharded.sharded_export(shard_all(whole, rank, 3), PLAN, GROUP)
        return str(e.value)

    return on_ranks(fake, body)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_weight_in_one_shard_is_refused_on_every_rank_before_any_value(fake, bad):
    whole = masters()
    whole[K][2, 7] = bad  # row 2: rank 1's first row
    said = refusals(fake, whole)
    assert K in said[1] and "rank 1's shard" in said[1] and "[0, 7]" in said[1]
    for r in (0, 2):
        assert "another rank's shard" in said[r] and f"['{K}']" in said[r]
    # nothing but the flags' all-reduce: no amax, no rows
    assert fake.ops(0) == fake.ops(1) == fake.ops(2) == [("reduce", 10)]


def test_a_non_finite_weight_of_a_gathered_tensor_is_refused_too(fake):
    whole = masters()
    whole[Q][3, 0] = float("nan")  # q_proj: rows 2 and 3 on rank 1, none on rank 2
    said = refusals(fake, whole)
    assert Q in said[1] and "rank 1's shard" in said[1]
    assert "another rank's shard" in said[0] and "another rank's shard" in said[2]


def test_the_refusal_names_the_first_five_non_finite_tensors(fake):
    whole = masters()
    names = list(SHAPES)
    for name in names[:6]:
        whole[name].view(-1)[0] = float("nan")  # row 0: rank 0's
    said = refusals(fake, whole)
    assert f"{names[:5]}" in said[1] and names[5] not in said[1]
    assert names[0] in said[0] and "rank 0's shard" in said[0]


def test_weights_that_are_not_the_plans_are_refused_before_any_collective(fake):
    whole = masters()
    del whole["model.norm.weight"]
    said = refusals(fake, whole)
    assert all(s.startswith("sharded export: the plan") for s in said.values())
    assert all("model.norm.weight" in s for s in said.values())
    assert fake.log == []


def test_bf16_tensors_take_the_dtype_asked_for_shard_local_or_gathered(fake):
    whole = masters()
    out = exported(fake, whole, bf16_dtype=torch.float16)
    reference = list(export_weights(whole, PLAN, bf16_dtype=torch.float16))
    for _, buckets in out.values():
        records = {r.name: r for b in buckets for r in b.records}
        assert_same_bytes(list(records.values()), reference)
        assert records["model.norm.weight"].value.dtype == torch.float16
    # gathered: the same, from a replicated router
    placements = {"model.layers.0.mlp.gate.weight": REPLICATED}
    for _, buckets in exported(
        fake, whole, placements=placements, bf16_dtype=torch.float16
    ).values():
        router = [r for b in buckets for r in b.records if r.name.endswith("gate.weight")]
        assert router[0].value.dtype == torch.float16
        assert torch.equal(router[0].value, whole["model.layers.0.mlp.gate.weight"].half())


def test_a_plan_without_quantized_tensors_has_no_sqnr_and_reduces_none(fake):
    plan = resolve("bf16", SHAPES)
    whole = masters()
    for exp, buckets in exported(fake, whole, plan).values():
        records = [r for b in buckets for r in b.records]
        assert all(r.value.dtype == torch.bfloat16 for r in records)
        assert exp.event.sqnr_db == {}
    assert [op for op, _ in fake.ops(0)].count("reduce") == 1  # the flags only


def test_the_quantizer_runs_on_the_backend_asked_for_but_block_fp8_of_no_kernel_size(
    fake, monkeypatch
):
    """A Kernels record whose quantizer is Triton: each tensor is quantized on it (recorded, then
    quantized on the reference), but block FP8 of a block no kernel has (2) on the reference."""
    seen = []
    real = sharded.kernel_quantize

    def recording(w, fmt, *, backend, **kwargs):
        seen.append((str(fmt), backend))
        return real(w, fmt, backend=Backend.REFERENCE, **kwargs)

    monkeypatch.setattr(sharded, "kernel_quantize", recording)
    kernels = Kernels.resolve("reference", torch.device("cpu"))
    kernels = dataclasses.replace(kernels, quantizer=Backend.TRITON)
    exported(fake, masters(), backend=kernels)
    assert {(f, b) for f, b in seen} == {
        ("mxfp8", Backend.TRITON), ("fp8_block", Backend.REFERENCE), ("nvfp4", Backend.TRITON)
    }  # fmt: skip
    assert len(seen) == 3 * 8  # eight quantized tensors on each rank
    # a block the kernels have (32): the backend asked for
    seen.clear()
    recipe = {**RECIPE, "rules": [{"match": {"kind": "lm_head"}, "format": "fp8_block",
                                   "block": [32, 32]}]}  # fmt: skip
    plan = resolve(recipe, {"lm_head.weight": (64, 32)})
    whole = {"lm_head.weight": torch.randn(64, 32, generator=torch.Generator().manual_seed(2))}
    exported(fake, whole, plan, backend=kernels)
    assert seen == [("fp8_block", Backend.TRITON)] * 3


def test_a_backend_the_device_cannot_run_is_refused(fake, monkeypatch):
    monkeypatch.setattr("mxrl.kernels.backend.check_triton_runs_on", _refuse)

    def body(rank):
        with pytest.raises(ValueError, match="no triton here"):
            exp = sharded.sharded_export(
                shard_all(masters(), rank, 3), PLAN, GROUP, backend="triton"
            )
            list(exp)
        return True

    on_ranks(fake, body)


def _refuse(device):
    raise ValueError("no triton here")


def test_a_non_finite_weight_in_a_one_element_shard_is_refused(fake):
    """3 elements over 3 ranks: each rank's shard is one value."""
    plan = resolve("bf16", {"model.norm.weight": (3,)})
    whole = {"model.norm.weight": torch.tensor([1.0, 2.0, float("nan")])}

    def body(rank):
        with pytest.raises(ValueError, match=r"refusing to export|non-finite") as e:
            sharded.sharded_export(shard_all(whole, rank, 3), plan, GROUP)
        return str(e.value)

    said = on_ranks(fake, body)
    assert "rank 2's shard" in said[2] and "another rank's shard" in said[0]


ROUTER = "model.layers.0.mlp.gate.weight"


def test_a_finite_master_past_bf16s_range_in_a_bf16_tensor_is_refused_on_every_rank(fake):
    """fp32's largest value is finite, and bf16 rounds it to Inf: the export would send Inf."""
    whole = masters()
    whole[ROUTER][2, 1] = torch.finfo(torch.float32).max  # row 2: rank 1's first row
    said = refusals(fake, whole)
    assert ROUTER in said[1] and "rank 1's shard" in said[1] and "range" in said[1]
    for r in (0, 2):
        assert "another rank's shard" in said[r] and f"['{ROUTER}']" in said[r]
        assert "torch.bfloat16's range" in said[r]
    assert fake.ops(0) == fake.ops(1) == fake.ops(2) == [("reduce", 10)]


def test_the_range_checked_is_the_exported_dtypes(fake):
    """70000 fits bf16 but not fp16: refused only where the bf16 tensors go out as fp16, and
    only in the tensors exported as bf16 (an NVFP4 tensor takes it in its global scale)."""
    whole = masters()
    whole[ROUTER][4, 0] = 7e4  # rank 2's one row
    for _, buckets in exported(fake, whole).values():  # bf16: sent as it rounds
        router = [r.value for b in buckets for r in b.records if r.name == ROUTER]
        assert router[0].dtype == torch.bfloat16 and torch.isfinite(router[0]).all()

    def body(rank):
        with pytest.raises(ValueError) as e:
            sharded.sharded_export(shard_all(whole, rank, 3), PLAN, GROUP, bf16_dtype=torch.float16)
        return str(e.value)

    said = on_ranks(fake, body)
    assert ROUTER in said[2] and "rank 2's shard" in said[2] and "float16" in said[2]
    assert "another rank's shard" in said[0] and "torch.float16's range" in said[0]
    quantized = masters()
    quantized[K][2, 0] = 7e4  # NVFP4: not cast to the bf16 dtype, so not refused
    for _, buckets in exported(fake, quantized, bf16_dtype=torch.float16).values():
        assert K in [r.name for b in buckets for r in b.records]
