"""mxrl.weights.finite: the NaN/Inf check queued (`FiniteCheck`), its verdict read once, and
the quantizers that read its amaxes on another stream (as the broadcast sender does)."""

from __future__ import annotations

import math

import pytest
import torch

from mxrl.recipe import resolve
from mxrl.weights import checksums, export, export_weights
from mxrl.weights.finite import FiniteCheck, check_finite
from tests.sync.helpers import ALL_NVFP4, hashes, tiny

GATE = "model.layers.0.mlp.shared_expert.gate_proj.weight"
UP = "model.layers.0.mlp.shared_expert.up_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"


def test_the_verdict_is_read_once_and_kept():
    plan = resolve(ALL_NVFP4, {GATE: (64, 64), UP: (64, 64), NORM: (64,)})
    tensors = {GATE: torch.ones(64, 64), UP: torch.full((64, 64), 0.5), NORM: torch.ones(64)}
    check = FiniteCheck(tensors, plan)
    assert sorted(check.amaxes) == [GATE, UP]  # there before the verdict: the quantizers'
    check.ready(torch.device("cpu"))  # nothing to order on the CPU
    first = check.result()
    assert first is check.amaxes and check.result() is first
    assert float(first[GATE]) == 1.0 and float(first[UP]) == 0.5

    tensors[NORM][7] = math.inf
    bad = FiniteCheck(tensors, plan)
    for _ in range(2):  # the same refusal each time it is read
        with pytest.raises(ValueError, match=rf"1 master weight\(s\) hold NaN/Inf: {NORM}: 1 "):
            bad.result()
    with pytest.raises(ValueError, match=rf"{NORM}: 1 non-finite, first {NORM}\[7\] = inf"):
        check_finite(tensors, plan)


@pytest.mark.gpu
def test_values_pulled_on_another_stream_wait_for_the_amaxes_they_read():
    """The broadcast sender pulls buckets on a side stream, while the check's amaxes were
    queued on the current one: the quantizers must follow them. Large masters make the amaxes
    slow, so a quantizer that did not wait would read them unfinished."""
    model = tiny(seed=3).cuda()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):  # global amaxes apart from tensor to tensor
            p.mul_(10.0 ** (i % 5 - 2))
    plan = resolve("nvfp4-dequantized", {n: p.shape for n, p in model.named_parameters()})
    want = hashes(export_weights(model.named_parameters(), plan))
    big = torch.randn(8192, 8192, device="cuda")  # ~0.1 ms of reading ahead of the check
    side = torch.cuda.Stream()
    for _ in range(3):
        big.abs_().amax()  # the current stream busy when the check is queued
        exp = export(model, plan, sqnr=False, bucket_bytes=1)
        with torch.cuda.stream(side):
            records = [r for bucket in exp for r in bucket.records]
        torch.cuda.synchronize()
        assert hashes(records) == want
        assert checksums([r.name for r in records], [r.value for r in records]) == [
            r.hash for r in records
        ]
