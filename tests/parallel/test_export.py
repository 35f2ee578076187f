"""Export from FSDP2-sharded masters (two gloo ranks): the same bytes as a single-process export
of the same master, for every preset's formats, shard-local and gathered tensors alike."""

from __future__ import annotations

import json

import pytest

from tests.parallel.export_worker import RECIPES
from tests.parallel.helpers import tail, torchrun


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_export")
    run = torchrun(["-m", "tests.parallel.export_worker", str(out)])
    assert run.returncode == 0, tail(run)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_sharded_export_is_byte_identical_to_a_single_process_export(ranks, recipe):
    for seen in ranks:
        case = seen[recipe]
        assert case["differ"] == [], "records whose bytes differ from the single-process export"
        assert case["differ_after_step"] == [], "after an optimizer step on the shards"
        assert case["engine_equal"], "an engine fed by the sharded export holds other bytes"
        assert case.get("logits_equal", True), "the sharded forward after two steps differs"
        sharded, single = case["num_buckets"]
        assert sharded == single
        # not vacuous: most tensors were quantized from shards, some gathered whole
        assert case["shard_local"] > 40 and case["gathered"] >= 4
        got, want = case["sqnr"]
        assert got.keys() == want.keys()
        for key in want:  # summed over shards in another order: equal to float64 rounding
            assert got[key] == pytest.approx(want[key], rel=1e-12)
    assert ranks[0][recipe] == ranks[1][recipe]


def test_fp8_block_gathers_tensors_whose_shards_cut_a_block(ranks):
    # 32x32 blocks: 64-row tensors shard by whole blocks, 32-row k/v projections (16 rows a
    # rank) and 1-row tensors are gathered
    assert ranks[0]["fp8-block-32"]["gathered"] > ranks[0]["mxfp8"]["gathered"]


def test_nan_in_one_rank_shard_is_refused_on_every_rank(ranks):
    holder, other = ranks[1]["nan"], ranks[0]["nan"]
    assert "q_proj" in holder and "non-finite" in holder and "rank 1's shard" in holder
    assert "q_proj" in other and "another rank's shard" in other


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    out = tmp_path_factory.mktemp("uneven_export")
    run = torchrun(["-m", "tests.parallel.uneven_worker", str(out)], nproc=3)
    assert run.returncode == 0, tail(run)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]


def test_uneven_shards_over_three_ranks_give_the_single_process_bytes(uneven):
    """Odd row counts over 3 ranks (torch.chunk sizes: the last shard shorter): each rank's
    gathered records equal a single-process export byte for byte, in every format."""
    held = {
        "lm_head.weight": [32, 32, 31],  # 95 rows, block FP8 32x32: a partial last block
        "model.embed_tokens.weight": [32, 32, 31],  # MXFP8
        "model.layers.0.mlp.experts.gate_up_proj": [2, 2, 1],  # 5 experts, NVFP4 per expert
        "model.layers.0.self_attn.k_proj.weight": [11, 11, 10],  # NVFP4, amax all-reduced
        "model.layers.0.mlp.shared_expert.up_proj.weight": [22, 22, 20],  # gate/up pair
        "model.layers.0.mlp.gate.weight": [2, 2, 1],  # bf16 router
        "model.norm.weight": [22, 22, 20],  # bf16, 1-D
    }
    for name, want in held.items():
        assert [seen["rows"][name] for seen in uneven] == want, name
    for seen in uneven:
        assert seen["world"] == 3
        assert seen["differ"] == [], "records whose bytes differ from the single-process export"
        assert seen["num_records"] == [63, 63]
        # every tensor quantized from its shards but the 1-row shared-expert gate of each of
        # the 4 layers (a rank would hold no row of it): gathered whole
        assert seen["gathered"] == 4 and seen["shard_local"] == 59
