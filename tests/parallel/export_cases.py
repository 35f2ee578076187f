"""The masters, plan and helpers of the one-process sharded-export tests
(test_export_edges.py, test_export_refusals.py): a 10-tensor plan of every format whose rows do
not split evenly over 3 ranks, each rank a thread of tests/parallel/fake_ranks.py."""

from __future__ import annotations

import torch

from mxrl.parallel import export as sharded
from mxrl.recipe import resolve
from mxrl.weights import export
from tests.parallel.fake_ranks import GROUP, FakeCollectives, Sharded, shard_all

_NVFP4 = {"format": "nvfp4", "activations": "per_token"}
RECIPE = {
    "name": "edges",
    "backward": "high_precision",
    "default": "bf16",
    "rules": [
        {"match": {"kind": "router"}, "format": "bf16"},
        {"match": {"kind": "lm_head"}, "format": "fp8_block", "block": [2, 2]},
        {"match": {"kind": "embedding"}, "format": "mxfp8"},
        {"match": {"kind": "attention"}, **_NVFP4},
        {"match": {"kind": "shared_expert"}, **_NVFP4, "fuse": ["gate", "up"]},
        {"match": {"kind": "routed_expert"}, **_NVFP4, "fuse": ["gate", "up"]},
    ],
}
SHAPES = {
    "model.embed_tokens.weight": (7, 32),  # MXFP8: 3, 3, 1 rows
    "lm_head.weight": (11, 4),  # block FP8 2x2: 4, 4, 3 rows (a partial last block); scales 2, 2, 2
    "model.layers.0.self_attn.k_proj.weight": (5, 32),  # NVFP4, amax all-reduced: 2, 2, 1
    "model.layers.0.self_attn.q_proj.weight": (4, 32),  # 2, 2, 0: rank 2 would hold none
    "model.layers.0.mlp.shared_expert.gate_proj.weight": (5, 32),  # a gate/up pair
    "model.layers.0.mlp.shared_expert.up_proj.weight": (5, 32),
    "model.layers.0.mlp.experts.gate_up_proj": (5, 4, 32),  # NVFP4 per expert: 2, 2, 1
    "model.layers.0.mlp.gate.weight": (5, 32),  # bf16 router
    "model.layers.1.self_attn.o_proj.weight": (7, 32),  # NVFP4, layer 1
    "model.norm.weight": (7,),  # bf16, 1-D: 3, 3, 1
}
PLAN = resolve(RECIPE, SHAPES)
K, Q = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight"
GATE = "model.layers.0.mlp.shared_expert.gate_proj.weight"
UP = "model.layers.0.mlp.shared_expert.up_proj.weight"
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"


def masters(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    # the largest magnitude of k_proj in rank 2's one row, of the gate/up pair in up's rank-1
    # rows: a shard's own amax is not the tensor's
    out[K][4, 3] = 40.0
    out[UP][2, 5] = -50.0
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def single(whole, plan=PLAN, **kwargs):
    """The single-process export of the whole masters, iterated: (its buckets, its event)."""
    exp = export(whole, plan, **kwargs)
    buckets = list(exp)
    return buckets, exp.event


def fields(value) -> dict[str, torch.Tensor]:
    return value.tensors() if hasattr(value, "tensors") else {"": value}


def assert_same_bytes(records, reference) -> None:
    assert [r.name for r in records] == [r.name for r in reference]
    for got, want in zip(records, reference, strict=True):
        a, b = fields(got.value), fields(want.value)
        assert a.keys() == b.keys(), got.name
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (got.name, k)
            assert torch.equal(as_bytes(a[k]), as_bytes(b[k])), (got.name, k)
        assert got.hash == want.hash, got.name


def use(monkeypatch, fake: FakeCollectives) -> FakeCollectives:
    monkeypatch.setattr(sharded, "dist", fake)
    monkeypatch.setattr(sharded, "DTensor", Sharded)
    return fake


def on_ranks(fake, body) -> dict[int, object]:
    """body(group rank) on every rank of `fake`, by global rank; a rank's exception is raised
    here."""
    out = fake.run(**{f"r{r}": (lambda i=i: body(i)) for i, r in enumerate(fake.ranks)})
    for r in fake.ranks:
        if isinstance(out[r], BaseException):
            raise out[r]
    return out


def exported(fake, whole, plan=PLAN, placements=None, **kwargs):
    """Each rank's (ShardedExport, its buckets) for the masters `whole`."""

    def body(rank):
        model = shard_all(whole, rank, len(fake.ranks), placements)
        exp = sharded.sharded_export(model, plan, GROUP, **kwargs)
        return exp, list(exp)

    return on_ranks(fake, body)
