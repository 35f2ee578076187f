"""Run by test_export.py under `torchrun --nproc-per-node 2`: FSDP2-shard the tiny MoE over
both ranks and export from the shards; compare every record, byte for byte, with a
single-process export of the same (whole) master, before and after an optimizer step on the
shards; an engine fed by the sharded export holds the single-process engine's bytes; NaN in
one rank's shard is refused on both. Each rank writes rank{r}.json into argv[1]."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mxrl.engine import Engine
from mxrl.nn import apply_plan
from mxrl.parallel import Layout, Placement, parallelize, sharded_export, unshard_module
from mxrl.parallel.parallelize import attach_cache_reset
from mxrl.recipe import resolve
from mxrl.sync import InProcessTransport
from mxrl.weights import export, export_weights
from tests.numerics import as_bytes
from tests.sync.helpers import ALL_NVFP4, FP8_BLOCK_32, tiny

# every 2-D tensor NVFP4 (a per-tensor global amax: all-reduced over the shards; the shared
# expert's gate and up share one: both all-reduced) and the experts NVFP4 (per expert, inside a
# shard); bf16 norms, router, embeddings. The export does not need apply_plan (it reads the
# master weights), so the models here are sharded without it: QLinear's 2-D fuse partner is
# refused by parallelize (mxrl/parallel/parallelize.py). FP8_BLOCK_32: 64-row tensors shard by
# whole blocks (32 rows a rank, quantized shard-locally), 32-row ones (k_proj, v_proj: 16 rows a
# rank) are gathered and quantized whole.
RECIPES = {
    "bf16": "bf16", "mxfp8": "mxfp8", "nvfp4-dequantized": "nvfp4-dequantized",
    "fp8-block-32": FP8_BLOCK_32, "all-nvfp4": ALL_NVFP4,
}  # fmt: skip


def _fields(value) -> dict[str, torch.Tensor]:
    return value.tensors() if hasattr(value, "tensors") else {"": value}


def _same(records, reference) -> list[str]:
    """Names of the records whose checksum or any byte differs from the reference's."""
    ref = {r.name: r for r in reference}
    bad = []
    for r in records:
        want = ref.pop(r.name)
        a, b = _fields(r.value), _fields(want.value)
        same = r.hash == want.hash and a.keys() == b.keys()
        same = same and all(
            a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
            and torch.equal(as_bytes(a[k]), as_bytes(b[k]))
            for k in a
        )  # fmt: skip
        if not same:
            bad.append(r.name)
    return bad + sorted(ref)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    layout = Layout.init(Placement(mode="colocated"))
    rank, seen = layout.rank, {}
    for key, recipe in RECIPES.items():
        model = tiny(seed=1)
        plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
        reference = list(export_weights(tiny(seed=1).named_parameters(), plan))
        quantized_forward = key != "all-nvfp4"  # QLinear's 2-D partner: see ALL_NVFP4
        if quantized_forward:
            apply_plan(model, plan)
        parallelize(model, plan, layout.train_mesh)
        exp = sharded_export(model, plan, layout.train_group, bucket_bytes=40_000, step=1)
        buckets = list(exp)
        got = [r for b in buckets for r in b.records]
        single = export(tiny(seed=1), plan, bucket_bytes=40_000, step=1)
        num_single = len(list(single))
        case = {
            "differ": _same(got, reference),
            "num_buckets": [len(buckets), num_single],
            "sqnr": [exp.event.sqnr_db, single.event.sqnr_db],
            "shard_local": exp.num_shard_local,
            "gathered": exp.num_gathered,
        }
        # one optimizer step on the shards, then: sharded export == export of the whole master
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        attach_cache_reset(model, opt)
        ids = torch.arange(16).reshape(2, 8) % 64
        for _ in range(2):  # the second forward quantizes the stepped weights (no stale cache)
            model(ids).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        whole = unshard_module(model)
        if quantized_forward:
            # the sharded trainer's forward is the unsharded one's on the gathered weights
            single = tiny(seed=0)
            single.load_state_dict(whole)
            apply_plan(single, plan)
            with torch.no_grad():
                case["logits_equal"] = torch.equal(model(ids), single(ids))
        stepped = list(sharded_export(model, plan, layout.train_group, step=2).records())
        case["differ_after_step"] = _same(stepped, export_weights(whole, plan))
        engine = Engine(tiny(seed=0), plan)
        InProcessTransport(engine).send(sharded_export(model, plan, layout.train_group, step=3))
        fresh = Engine(tiny(seed=0), plan)
        fresh.load_weights(export_weights(whole, plan), plan.hash())
        case["engine_equal"] = {r.name: r.hash for r in engine.records()} == {
            r.name: r.hash for r in fresh.records()
        }
        seen[key] = case
    # NaN in rank 1's shard only: refused on both ranks, before any bucket
    model = tiny(seed=1)
    plan = resolve("mxfp8", {n: p.shape for n, p in model.named_parameters()})
    apply_plan(model, plan)
    parallelize(model, plan, layout.train_mesh)
    if rank == 1:
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.to_local()[0, 0] = float("nan")
    try:
        sharded_export(model, plan, layout.train_group)
        seen["nan"] = "exported"
    except ValueError as e:
        seen["nan"] = str(e)
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    layout.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
