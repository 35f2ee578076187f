"""The edges of mxrl/parallel/export.py inside one process: every rank a thread, FSDP2's DTensor
stood in for (tests/parallel/fake_ranks.py), so that mutmut's per-function test selection sees
the export (test_export.py's torchrun ranks it cannot).

Uneven shards throughout: 7 rows over 3 ranks are 3, 3 and 1 rows; 5 rows are 2, 2, 1; 4 rows
would leave rank 2 nothing (gathered whole instead). Each rank's records are held byte for byte
to a single-process export of the whole tensors (`export_weights`, another code path: no shard,
no collective), and each collective's size to the padded chunk worked out by hand."""

from __future__ import annotations

import pytest
import torch

from mxrl.parallel import export as sharded
from mxrl.recipe import resolve
from mxrl.weights import export, export_weights
from mxrl.weights.event import SqnrSample
from tests.parallel.export_cases import (
    EXPERTS,
    PLAN,
    RECIPE,
    SHAPES,
    K,
    Q,
    as_bytes,
    assert_same_bytes,
    exported,
    fields,
    masters,
    on_ranks,
    single,
    use,
)
from tests.parallel.fake_ranks import (
    BY_COLUMN,
    GROUP,
    REPLICATED,
    TWO_D,
    FakeCollectives,
    Model,
    shard_all,
)


def test_gathered_rows_of_uneven_shards_are_the_whole_tensor_in_order(fake):
    whole = torch.arange(14, dtype=torch.int16).reshape(7, 2)  # 3, 3, 1 rows

    def body(rank):
        return sharded._gather_rows(whole[3 * rank : 3 * rank + 3], 7, 3, GROUP)

    for got in on_ranks(fake, body).values():
        assert got.dtype == torch.int16 and got.tolist() == [[2 * i, 2 * i + 1] for i in range(7)]
    # each rank sends its rows padded to 3 rows of 4 bytes (the last rank's 1 row too)
    assert [fake.ops(r) for r in (0, 1, 2)] == [[("gather", 12)]] * 3


def test_gathered_rows_keep_trailing_dims_and_float_bits(fake):
    whole = torch.tensor([-0.0, 1.5, float("inf"), 3.25, -7.0, 2.0**-140] * 5).reshape(5, 2, 3)

    def body(rank):
        return sharded._gather_rows(whole[2 * rank : 2 * rank + 2], 5, 3, GROUP)

    for got in on_ranks(fake, body).values():
        assert got.shape == (5, 2, 3) and got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), whole.view(torch.int32))  # -0.0, subnormal
    assert fake.ops(2) == [("gather", 2 * 6 * 4)]  # 2 rows of 6 fp32, rank 2's 1 row padded


def test_every_rank_exports_the_single_process_bytes_from_uneven_shards(fake):
    whole = masters()
    reference = list(export_weights(whole, PLAN))
    out = exported(fake, whole, step=4, bucket_bytes=1 << 20)
    for exp, buckets in out.values():
        assert_same_bytes([r for b in buckets for r in b.records], reference)
        assert (exp.num_shard_local, exp.num_gathered) == (9, 1)  # q_proj gathered whole
        assert [b.step for b in buckets] == [4] and buckets[-1].last
        assert exp.step == 4 and exp.plan_hash == PLAN.hash() and exp.plan is PLAN


# rank 0's collectives, in plan order, worked out by hand (bytes a rank sends, padded chunks)
RANK0_OPS = [
    ("reduce", 10),  # one non-finite flag per tensor
    ("gather", 3 * 32), ("gather", 3 * 1),  # embedding: MXFP8 qdata, E8M0 scales (3 rows)
    ("gather", 4 * 4), ("gather", 2 * 2 * 4),  # lm_head: 4 rows, 2 rows of 2 fp32 block scales
    ("reduce", 1), ("gather", 2 * 16), ("gather", 2 * 2),  # k_proj: amax, nibbles, scales
    # q_proj: gathered whole, no collective of the export's own
    ("reduce", 1), ("gather", 2 * 16), ("gather", 2 * 2),  # gate (amax with up's)
    ("reduce", 1), ("gather", 2 * 16), ("gather", 2 * 2),  # up
    ("gather", 2 * 4), ("gather", 2 * 4 * 16), ("gather", 2 * 4 * 2),  # experts: gs first
    ("gather", 2 * 32 * 2),  # router, bf16
    ("reduce", 1), ("gather", 3 * 16), ("gather", 3 * 2),  # o_proj
    ("gather", 3 * 2),  # norm, bf16, 1-D
    ("reduce", 3 * 2),  # SQNR: [signal, noise] of layer.0, layer.1, other
]  # fmt: skip


def test_each_collective_sends_the_padded_chunk_worked_out_by_hand(fake):
    for exp, buckets in exported(fake, masters()).values():
        assert exp.step == 0 and {b.step for b in buckets} == {0}  # the default step
    assert fake.ops(0) == fake.ops(1) == fake.ops(2) == RANK0_OPS


def test_the_sqnr_is_the_single_process_exports_summed_over_shards(fake):
    whole = masters()
    want = single(whole)[1].sqnr_db
    for exp, _ in exported(fake, whole).values():
        assert exp.event.sqnr_db.keys() == want.keys() == {"layer.0", "layer.1", "other"}
        for key in want:
            assert exp.event.sqnr_db[key] == pytest.approx(want[key], rel=1e-12)


def test_a_sampled_sqnr_measures_the_experts_of_the_whole_stack_not_of_each_shard(fake):
    """5 experts over stride 2: group 1 is experts 3 and 4 (floor(e * 2 / 5) = 1), held by
    ranks 1 and 2 from their first expert (2 and 4) on."""
    whole = masters(3)
    whole[EXPERTS][:3, :, 0] = 300.0  # experts 0-2: an outlier per row, another SQNR
    sample = SqnrSample(stride=2, phase=1)
    want = single(whole, sqnr=sample)[1].sqnr_db
    assert want["layer.0"] != pytest.approx(single(whole)[1].sqnr_db["layer.0"])
    for exp, _ in exported(fake, whole, sqnr=sample).values():
        assert exp.event.sqnr_db["layer.0"] == pytest.approx(want["layer.0"], rel=1e-12)


def test_without_sqnr_the_event_has_none_and_no_sum_is_reduced(fake):
    for exp, buckets in exported(fake, masters(), sqnr=False).values():
        assert exp.event.sqnr_db == {} and buckets[-1].event is exp.event
    assert fake.ops(0)[-1] == ("gather", 3 * 2)  # the norm's rows, last: no SQNR reduce


def test_the_event_is_there_after_the_last_bucket_and_on_it(fake):
    def body(rank):
        model = shard_all(masters(), rank, 3)
        exp = sharded.sharded_export(model, PLAN, GROUP, step=9, bucket_bytes=300)
        with pytest.raises(RuntimeError, match="last bucket first"):
            _ = exp.event
        buckets = list(exp)
        return exp, buckets

    for exp, buckets in on_ranks(fake, body).values():
        assert len(buckets) > 1
        assert buckets[-1].event is exp.event and [b.event for b in buckets[:-1]] == [None] * (
            len(buckets) - 1
        )


def test_small_buckets_cut_where_the_single_process_export_cuts(fake):
    whole = masters()
    want = [[r.name for r in b.records] for b in single(whole, bucket_bytes=300, step=2)[0]]
    assert len(want) > 3
    for exp, buckets in exported(fake, whole, bucket_bytes=300, step=2).values():
        assert [[r.name for r in b.records] for b in buckets] == want
        assert {b.step for b in buckets} == {2} and exp.event.step == 2
        assert exp.event.num_tensors == 10 and 0 <= exp.event.seconds < 60
        with pytest.raises(RuntimeError, match="iterated once"):
            list(exp.records())


def test_records_are_every_buckets_records_in_plan_order(fake):
    def body(rank):
        exp = sharded.sharded_export(shard_all(masters(), rank, 3), PLAN, GROUP, bucket_bytes=300)
        return list(exp.records()), exp.event

    for records, event in on_ranks(fake, body).values():
        assert_same_bytes(records, list(export_weights(masters(), PLAN)))
        assert event.num_tensors == 10


@pytest.mark.parametrize("how", ["replicated", "two-d mesh", "by column", "plain tensor"])
def test_tensors_not_sharded_by_rows_over_one_mesh_dim_are_gathered_whole(fake, how):
    whole = masters()
    if how == "plain tensor":

        def model(rank):
            params = shard_all(whole, rank, 3).params
            return Model({**params, K: whole[K], "model.norm.weight": whole["model.norm.weight"]})

    else:
        other = {"replicated": REPLICATED, "two-d mesh": TWO_D, "by column": BY_COLUMN}[how]

        def model(rank):
            return shard_all(whole, rank, 3, {K: other, "model.norm.weight": other})

    def body(rank):
        exp = sharded.sharded_export(model(rank), PLAN, GROUP)
        return exp, list(exp.records())

    for exp, records in on_ranks(fake, body).values():
        assert_same_bytes(records, list(export_weights(whole, PLAN)))
        assert (exp.num_shard_local, exp.num_gathered) == (7, 3)


def test_one_rank_quantizes_every_tensor_whole(monkeypatch):
    fake = use(monkeypatch, FakeCollectives(ranks=(0,), group=GROUP))
    whole = masters()
    (exp, buckets), = exported(fake, whole).values()  # fmt: skip
    assert_same_bytes([r for b in buckets for r in b.records], list(export_weights(whole, PLAN)))
    assert (exp.num_shard_local, exp.num_gathered) == (0, 10)
    # the gathered tensors' SQNR counted on this rank, group rank 0
    want = single(whole)[1].sqnr_db
    assert exp.event.sqnr_db == pytest.approx(want, rel=1e-12)


def test_block_fp8_shards_by_whole_row_blocks_or_is_gathered(fake):
    """Block rows 2: 11 rows over 3 ranks are 4, 4, 3 (whole blocks but the last: shard-local),
    7 rows are 3, 3, 1 (a block cut at rows 3 and 6: gathered); 3 experts, one a rank, shard
    by expert whatever the block (a 3-D tensor's blocks are within one expert)."""
    shapes = {
        "lm_head.weight": (7, 4),
        "model.layers.0.mlp.experts.down_proj": (3, 4, 2),
        "model.embed_tokens.weight": (11, 4),
    }
    plan = resolve(
        {**RECIPE, "rules": [
            {"match": {"kind": "lm_head"}, "format": "fp8_block", "block": [2, 2]},
            {"match": {"kind": "embedding"}, "format": "fp8_block", "block": [2, 2]},
            {"match": {"kind": "routed_expert"}, "format": "fp8_block", "block": [2, 2]},
        ]},
        shapes,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    whole = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    for exp, buckets in exported(fake, whole, plan).values():
        records = [r for b in buckets for r in b.records]
        assert_same_bytes(records, list(export_weights(whole, plan)))
        assert (exp.num_shard_local, exp.num_gathered) == (2, 1)
    # the embedding's 6 scale rows: 2 a rank (ceil nests), 2 fp32 each; the experts' 1 a rank
    assert ("gather", 2 * 2 * 4) in fake.ops(2) and ("gather", 1 * 2 * 1 * 4) in fake.ops(2)


def test_a_layer_whose_quantized_tensors_are_all_gathered_is_summed_from_rank_0_alone(fake):
    """layer 1's one quantized tensor has 4 rows (2, 2, 0: gathered whole): only rank 0 adds
    its sums, the other ranks add zeros for the key."""
    shapes = {**SHAPES, "model.layers.1.self_attn.o_proj.weight": (4, 32)}
    plan = resolve(RECIPE, shapes)
    g = torch.Generator().manual_seed(11)
    whole = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    exp = export(whole, plan)
    list(exp)
    want = exp.event.sqnr_db
    for got, _ in exported(fake, whole, plan).values():
        assert got.num_gathered == 2 and got.event.sqnr_db.keys() == want.keys()
        for key in want:
            assert got.event.sqnr_db[key] == pytest.approx(want[key], rel=1e-12)


@pytest.mark.gpu
def test_on_a_gpu_every_collective_and_record_stays_on_the_masters_device(monkeypatch):
    """The masters on a GPU: the stand-in refuses any collective tensor elsewhere (as NCCL
    would), and each record holds the CPU export's bytes, on the GPU. q_proj's empty shard on
    rank 2 (a flag not read from a tensor) and layer 1's gathered o_proj (a key ranks 1 and 2
    add zeros for) are made by the export itself, on the masters' device."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    fake = use(monkeypatch, FakeCollectives(ranks=(0, 1, 2), group=GROUP, device=cuda))
    shapes = {**SHAPES, "model.layers.1.self_attn.o_proj.weight": (4, 32)}
    plan = resolve(RECIPE, shapes)
    g = torch.Generator().manual_seed(11)
    whole = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    reference = {r.name: r for r in export_weights(whole, plan)}
    on_gpu = {n: t.to(cuda) for n, t in whole.items()}
    for exp, buckets in exported(fake, on_gpu, plan).values():
        for record in (r for b in buckets for r in b.records):
            got, want = fields(record.value), fields(reference[record.name].value)
            for k in got:
                assert got[k].device == cuda, (record.name, k)
                assert torch.equal(as_bytes(got[k]).cpu(), as_bytes(want[k])), (record.name, k)
        assert (exp.num_shard_local, exp.num_gathered) == (8, 2)
        assert exp.event.sqnr_db.keys() == {"layer.0", "layer.1", "other"}


def test_a_train_group_of_other_global_ranks_exports_by_its_own_ranks(monkeypatch):
    """Global ranks 4, 5, 6 are the group's 0, 1, 2: group rank 0 alone counts the gathered
    q_proj's SQNR, and each rank's first expert is its group rank times 2."""
    fake = use(monkeypatch, FakeCollectives(ranks=(4, 5, 6), group=GROUP))
    whole = masters(3)
    whole[EXPERTS][:3, :, 0] = 300.0
    sample = SqnrSample(stride=2, phase=1)
    want = single(whole, sqnr=sample)[1].sqnr_db
    for exp, buckets in exported(fake, whole, sqnr=sample).values():
        assert_same_bytes(
            [r for b in buckets for r in b.records], list(export_weights(whole, PLAN))
        )
        assert exp.event.sqnr_db == pytest.approx(want, rel=1e-12)


def test_a_sampled_expert_is_found_by_its_global_index_on_a_stack_of_other_width(fake):
    """Stride 5 over 5 experts: one expert a group, phase 2 measures expert 2 alone, rank 1's
    first (rows 2 and 3 of 5: 5 / 3 rounded up). The stack is 8 wide, so its second dim would
    give another first expert."""
    shapes = {EXPERTS: (5, 8, 32)}
    plan = resolve(RECIPE, shapes)
    whole = {EXPERTS: torch.randn(5, 8, 32, generator=torch.Generator().manual_seed(4))}
    whole[EXPERTS][2, :, 0] = 300.0  # expert 2 alone: an outlier per row, another SQNR
    sample = SqnrSample(stride=5, phase=2)
    exp = export(whole, plan, sqnr=sample)
    list(exp)
    want = exp.event.sqnr_db["layer.0"]
    exp = export(whole, plan, sqnr=SqnrSample(stride=5, phase=3))
    list(exp)
    assert abs(exp.event.sqnr_db["layer.0"] - want) > 10  # expert 3's: far from expert 2's
    for got, _ in exported(fake, whole, plan, sqnr=sample).values():
        assert got.event.sqnr_db["layer.0"] == pytest.approx(want, rel=1e-12)


def test_masters_on_the_cpu_quantize_on_the_cpu_where_a_gpu_is_present(fake, monkeypatch):
    """The backend is the masters' device's default, not the machine's (which would be Triton
    on a GPU): a GPU is made to look present."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    whole = masters()
    for _, buckets in exported(fake, whole).values():
        assert_same_bytes(
            [r for b in buckets for r in b.records], list(export_weights(whole, PLAN))
        )


def test_a_record_of_a_whole_bf16_master_is_a_copy_not_the_master(fake):
    """A plain tensor (held whole) already in the export's bf16 dtype: the record must not be
    the master itself, which the next optimizer step changes in place."""
    whole = masters()
    norm = whole["model.norm.weight"].to(torch.bfloat16)

    def body(rank):
        model = shard_all(whole, rank, 3)
        model.params["model.norm.weight"] = norm
        records = list(sharded.sharded_export(model, PLAN, GROUP).records())
        return next(r for r in records if r.name == "model.norm.weight")

    records = on_ranks(fake, body).values()
    before = norm.clone()
    norm.add_(1.0)  # the step, after the export
    for record in records:
        assert torch.equal(record.value, before)


def test_a_plan_whose_quantized_tensors_are_all_gathered_sums_on_rank_0_alone(fake):
    """q_proj (2, 2, 0 rows: gathered) is the one quantized tensor: ranks 1 and 2 add float64
    zeros for its key, as rank 0 adds its float64 sums."""
    shapes = {Q: (4, 32), "model.norm.weight": (7,)}
    plan = resolve(RECIPE, shapes)
    g = torch.Generator().manual_seed(12)
    whole = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    want = single(whole, plan=plan)[1].sqnr_db
    for exp, _ in exported(fake, whole, plan).values():
        assert (exp.num_shard_local, exp.num_gathered) == (1, 1)
        assert exp.event.sqnr_db == pytest.approx(want, rel=1e-12) and list(want) == ["layer.0"]
    assert fake.ops(1)[-1] == ("reduce", 2)
