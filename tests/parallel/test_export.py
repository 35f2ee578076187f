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
