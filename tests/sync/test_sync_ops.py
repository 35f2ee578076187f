"""The torch ops one loop sync dispatches, per record, pinned: the sync is host-bound on a GPU
(docs/benchmarks.md, "The sync as the loop runs it": ~470 launches and the records' bookkeeping
around 14 ms of kernels), so an op more per record is a launch more per record there.

Counted as the GRPO loop syncs (`mxrl.rl.trainer`): `InProcessTransport(engine).send(export(
model, plan, step=s, sqnr=SqnrSample.at_step(s, 16)))`, after a first sync (which installs the
engine's buffers). Each kernel call (a checksum batch, a quantization, an SQNR sum: a Triton op
or few on CUDA, the reference's many ops here; the engine's operands of a received QTensor,
mxrl/nn's) counts as one op, and the ops inside it are not counted.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mxrl.engine import Engine
from mxrl.formats.constants import Format
from mxrl.sync import InProcessTransport
from mxrl.weights import export
from mxrl.weights.event import SqnrSample
from tests.sync.helpers import FP8_BLOCK_32, tiny

KERNEL_CALLS = (  # where the sync calls a kernel, as those modules bound the names
    ("mxrl.weights.digest", "field_digests"),
    ("mxrl.weights.export", "kernel_quantize"),
    ("mxrl.weights.export", "quantize_measured"),
    ("mxrl.weights.event", "error_sums"),
    ("mxrl.nn.paths.rollout", "received_weight"),
)


class SyncOps(TorchDispatchMode):
    """Every aten op dispatched outside the kernel calls, by name, and each kernel call as
    "kernel:<name>"."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.inside = 0
        for module, attr in KERNEL_CALLS:
            monkeypatch.setattr(sys.modules[module], attr, self._wrap(module, attr))

    def _wrap(self, module: str, attr: str):
        fn = getattr(sys.modules[module], attr)

        def call(*args, **kwargs):
            if not self.inside:
                self.ops[f"kernel:{attr}"] += 1
            self.inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside -= 1

        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def sync_ops(preset, monkeypatch) -> tuple[Engine, Counter[str]]:
    model = tiny(seed=1)
    engine = Engine(model, preset, device="cpu", compute_dtype=torch.bfloat16)
    transport = InProcessTransport(engine)
    transport.send(export(model, engine.plan, step=1, sqnr=SqnrSample.at_step(1, 16)))
    counter = SyncOps(monkeypatch)
    with counter:
        transport.send(export(model, engine.plan, step=2, sqnr=SqnrSample.at_step(2, 16)))
    return engine, counter.ops


# The copies a load makes into the live buffers of one QTensor on the CPU engine: one per
# distinct storage among the leaves its module holds (mxrl/nn's QWeight: the QTensor's fields,
# NVFP4's decode scale, the fp32 operands of the CPU's unpacked GEMM); an engine whose GEMM reads
# the QTensor packed (a GPU's) holds the fields alone.
ENGINE_COPIES = {Format.MXFP8: 3, Format.FP8_BLOCK: 3, Format.NVFP4: 6}


def expected_ops(plan) -> Counter[str]:
    """The ops of one loop sync of `plan`'s records in one bucket, counted by hand."""
    specs = list(plan.values())
    bf16 = [s for s in specs if s.format is Format.BF16]
    quantized = [s for s in specs if s.format is not Format.BF16]
    nvfp4 = [s for s in quantized if s.format is Format.NVFP4]
    stacks = [s for s in quantized if len(s.shape) == 3]  # the SQNR samples their experts
    ops: Counter[str] = Counter()
    # export(): each master detached once (the finite check, the quantizer and the SQNR share it)
    ops["detach"] += len(specs)
    # check_finite: one read per tensor, an aminmax, or for NVFP4 its global amax (the infinity
    # norm of a detached view, flattened); then one stack of the quantized tensors' 0-d mins
    # and maxes, one cat with the amaxes and one isfinite (abs, ne, eq, mul); the bf16 tensors'
    # (fp32 masters exported as bf16) one stack, cast to bf16 and one isfinite; the two flags
    # cat together, read at once
    ops["aminmax"] += len(specs) - len(nvfp4)
    ops["linalg_vector_norm"] += len(nvfp4)
    ops["detach"] += len(nvfp4)
    ops["view"] += len(nvfp4)
    floats = len(quantized) - len(nvfp4)
    if floats:
        ops["stack"] += 1
    if floats or nvfp4:
        ops.update(["cat", "abs", "ne", "eq", "mul"])
    if bf16:
        ops.update(["stack", "_to_copy", "abs", "ne", "eq", "mul"])
    if bf16 and (floats or nvfp4):
        ops["cat"] += 1
    # quantized_values: a bf16 copy, or one quantizer call (asked for the SQNR's terms too,
    # which the reference quantizer does not sum: None here, one cat of them on a GPU)
    ops["_to_copy"] += len(bf16)
    ops["kernel:quantize_measured"] += len(quantized)
    # the sampled SQNR: one error_sums per quantized tensor; an expert stack's sample is a view
    # of the master and of each batched field (qdata, scale; NVFP4's per-expert global scale);
    # the sums of every tensor are stacked once for the one host read
    ops["kernel:error_sums"] += len(quantized)
    ops["slice"] += sum(4 if s.format is Format.NVFP4 else 3 for s in stacks)
    ops["stack"] += 1 if quantized else 0
    # checksums: one batch for the bucket on send, one on receive; on the CPU each batch's
    # digests come back through .numpy() (a detach)
    ops["kernel:field_digests"] += 2
    ops["detach"] += 2
    # the NVFP4 global scales of the update: each flattened, one cat, isfinite, > 0, &, all,
    # and the flag made 1-D for the one host read
    if nvfp4:
        ops["view"] += len(nvfp4) + 1
        ops.update(["cat", "abs", "ne", "eq", "mul", "gt", "bitwise_and", "all"])
    # the load: one copy per bf16 tensor; per QTensor the engine's operands (mxrl/nn) and a
    # copy per storage it holds
    ops["copy_"] += len(bf16) + sum(ENGINE_COPIES[s.format] for s in quantized)
    ops["kernel:received_weight"] += len(quantized)
    return ops


@pytest.mark.parametrize("preset", ["bf16", "mxfp8", "fp8-block-32", "nvfp4-dequantized"])
def test_a_loop_sync_dispatches_the_ops_counted_by_hand(preset, monkeypatch):
    """Per record: bf16 4 ops (a detach, its read, its copy, the load's copy); MXFP8 2-D 7
    (a detach, its read, the quantizer, the SQNR's sums, the engine's operands, the load's
    copies: 3 on the CPU, 2 on a packed GPU engine), an expert stack 3 more (the sample's
    views); a few per update (the checks' reductions, the checksums). Before the per-record
    work was cut (commit 01d7ef1) the same syncs took 2 detaches and 2 views more per tensor
    (bf16 6 ops), and 1 to 4 more per quantized one (the SQNR's running sums)."""
    recipe = FP8_BLOCK_32 if preset == "fp8-block-32" else preset
    engine, ops = sync_ops(recipe, monkeypatch)
    assert ops == expected_ops(engine.plan)
