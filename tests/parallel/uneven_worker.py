"""Run by test_export.py under `torchrun --nproc-per-node 3`: a tiny MoE whose tensors do not
split evenly over 3 ranks (95-row embedding and lm_head: 32 32 31 rows; 5 experts: 2 2 1;
32-row k/v: 11 11 10; 64-row tensors and norms: 22 22 20), FSDP2-sharded and exported from the
shards, every format on a short last shard (MXFP8, NVFP4 per tensor and per expert, gate/up
pairs sharing a scale, block FP8 with a partial last block, bf16). Each rank writes
rank{r}.json into argv[1]: the records that differ from a single-process export of the same
master, and what each rank held."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mxrl.arch import builtin_config
from mxrl.models import build_model
from mxrl.parallel import Layout, Placement, parallelize, sharded_export
from mxrl.recipe import resolve
from mxrl.weights import export_weights
from tests.parallel.export_worker import _same

CONFIG = {**builtin_config("tiny-moe"), "vocab_size": 95, "num_experts": 5}
_NVFP4 = {"format": "nvfp4", "activations": "per_token"}
UNEVEN = {
    "name": "uneven",
    "backward": "high_precision",
    "default": "bf16",
    "rules": [
        {"match": {"kind": "router"}, "format": "bf16"},
        {"match": {"kind": "lm_head"}, "format": "fp8_block", "block": [32, 32]},
        {"match": {"kind": "embedding"}, "format": "mxfp8"},
        {"match": {"kind": "attention"}, **_NVFP4},
        {"match": {"kind": "shared_expert"}, **_NVFP4, "fuse": ["gate", "up"]},
        {"match": {"kind": "routed_expert"}, **_NVFP4, "fuse": ["gate", "up"]},
    ],
}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    layout = Layout.init(Placement(mode="colocated"))
    model = build_model(CONFIG, seed=1)
    plan = resolve(UNEVEN, {n: p.shape for n, p in model.named_parameters()})
    reference = list(export_weights(build_model(CONFIG, seed=1).named_parameters(), plan))
    parallelize(model, plan, layout.train_mesh)
    exp = sharded_export(model, plan, layout.train_group, bucket_bytes=40_000)
    got = [r for b in exp for r in b.records]
    rows = {
        n: p.to_local().shape[0] if isinstance(p, DTensor) else None
        for n, p in model.named_parameters()
    }
    seen = {
        "differ": _same(got, reference),
        "num_records": [len(got), len(reference)],
        "shard_local": exp.num_shard_local,
        "gathered": exp.num_gathered,
        "rows": rows,
        "world": dist.get_world_size(layout.train_group),
    }
    dist.barrier()
    (out / f"rank{layout.rank}.json").write_text(json.dumps(seen))
    layout.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
