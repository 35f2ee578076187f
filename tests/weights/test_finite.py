"""mxrl.weights.finite: the NaN/Inf check queued (`FiniteCheck`), its verdict read once, and
the quantizers that read its amaxes on another stream (as the broadcast sender does)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mxrl.recipe import resolve
from mxrl.weights import WHOLE_UPDATE, checksums, export, export_weights
from mxrl.weights.finite import FiniteCheck, check_finite
from tests.kernels.test_decode_gemm import interpreter
from tests.sync.helpers import ALL_NVFP4, FP8_BLOCK_32, hashes, tiny

GATE = "model.layers.0.mlp.shared_expert.gate_proj.weight"
UP = "model.layers.0.mlp.shared_expert.up_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"


class Reads(TorchDispatchMode):
    """Counts the reductions a check could read a tensor with: (op, dtype) of each aminmax and
    amax dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("aminmax", "amax"):
            self.seen[(name, args[0].dtype)] += 1
        return func(*args, **(kwargs or {}))


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
@pytest.mark.parametrize("bucket_bytes", [WHOLE_UPDATE, 10**9])  # the values' check, the masters'
def test_values_pulled_on_another_stream_wait_for_the_amaxes_they_read(bucket_bytes):
    """The broadcast sender pulls buckets on a side stream, while the check's amaxes are
    queued on the current one, here behind a 50 ms sleep: the quantizers (and the values'
    flags) must wait for them. The masters are doubled every round, so amaxes left in reused
    memory by the round before are wrong: a quantizer that did not wait writes other bytes."""
    model = tiny(seed=3).cuda()
    plan = resolve("nvfp4-dequantized", {n: p.shape for n, p in model.named_parameters()})
    side = torch.cuda.Stream()
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2.0)
        want = hashes(export_weights(model.named_parameters(), plan))
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms of the current stream, ahead of the check
        exp = export(model, plan, sqnr=False, bucket_bytes=bucket_bytes)
        with torch.cuda.stream(side):
            records = [r for bucket in exp for r in bucket.records]
        torch.cuda.synchronize()
        assert hashes(records) == want
        assert checksums([r.name for r in records], [r.value for r in records]) == [
            r.hash for r in records
        ]


BAD_PLACES = {  # a tensor of each kind: an attention projection, an expert stack, a norm
    "model.layers.1.self_attn.o_proj.weight": (3, 5),
    "model.layers.2.mlp.experts.down_proj": (1, 2, 3),
    "model.layers.0.input_layernorm.weight": (4,),
}


def refusals(model, plan, bad, *exports) -> list[list[str]]:
    """Put `bad` at every BAD_PLACES element of `model`, then for each export's keywords the
    refusal's per-tensor descriptions (tensor, count, first element), sorted."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, index in BAD_PLACES.items():
            params[name][index] = bad
    messages = []
    for kwargs in exports:
        with pytest.raises(ValueError, match="refusing to export: 3 master weight") as err:
            next(iter(export(model, plan, **kwargs)))
        messages.append(sorted(str(err.value).split(": ", 2)[2].split(". Nothing")[0].split("; ")))
    return messages


@pytest.mark.parametrize("preset", ["bf16", "mxfp8", "fp8-block", "nvfp4-dequantized"])
@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_one_bucket_checks_the_values_and_refuses_what_the_masters_check_refuses(preset, bad):
    """WHOLE_UPDATE checks each tensor but NVFP4's on its exported bytes (bf16 copies, E4M3
    codes); the refusal names the same tensors, counts and first elements as the check of
    the masters (several buckets)."""
    model = tiny(seed=4)
    recipe = FP8_BLOCK_32 if preset == "fp8-block" else preset
    plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
    one, many = refusals(
        model, plan, bad, {"bucket_bytes": WHOLE_UPDATE, "sqnr": False},
        {"bucket_bytes": 1 << 16, "sqnr": False},
    )  # fmt: skip
    assert one == many
    assert any("experts.1.down_proj.weight[2, 3]" in m for m in one)


def test_one_bucket_reads_the_values_not_the_masters():
    """On one bucket, no master but an NVFP4 one is read by the check: the E4M3 codes' largest
    byte and the bf16 copies' min and max are."""
    model = tiny(seed=4)
    plan = resolve("mxfp8", {n: p.shape for n, p in model.named_parameters()})
    bf16 = sum(1 for s in plan.values() if s.format.value == "bf16")
    with Reads() as reads:
        records = list(export(model, plan, bucket_bytes=WHOLE_UPDATE, sqnr=False).records())
    assert reads.seen[("aminmax", torch.bfloat16)] == bf16  # the bf16 copies
    assert reads.seen[("amax", torch.int8)] == len(plan) - bf16  # the codes
    assert reads.seen[("aminmax", torch.float32)] == 0  # no master
    assert hashes(records) == hashes(export_weights(model.named_parameters(), plan))


def test_a_finite_master_past_bf16s_range_is_refused_on_one_bucket_and_on_many():
    """Its bf16 copy is Inf: what the engine would hold. The check of the values names it as
    finite; the masters' check (several buckets, export_weights) casts each bf16 tensor's min
    and max as the export casts the tensor and refuses it with the same words (it used to let it
    through, and the engine got an Inf weight)."""
    model = tiny(seed=4)
    plan = resolve("bf16", {n: p.shape for n, p in model.named_parameters()})
    name = "model.layers.0.input_layernorm.weight"
    with torch.no_grad():
        dict(model.named_parameters())[name][2] = 3.3961775292e38  # fp32 0x7F7F8000: bf16 Inf
    exp = export(model, plan, bucket_bytes=WHOLE_UPDATE)
    with pytest.raises(
        ValueError, match=rf"{name}: finite, but 1 value\(s\) past torch.bfloat16"
    ) as e:
        next(iter(exp))
    assert f"as non-finite, first {name}[2] = 3.3961775292" in str(e.value)
    stack = dict(model.named_parameters())["model.layers.2.mlp.experts.gate_up_proj"]
    with torch.no_grad():  # the up half of expert 1: located as the per-expert tensor
        stack[1, stack.shape[1] // 2 + 2, 3] = -3.3961775292e38
    with pytest.raises(ValueError, match="2 master weight") as e:
        next(iter(export(model, plan, bucket_bytes=WHOLE_UPDATE)))
    assert "first model.layers.2.mlp.experts.1.up_proj.weight[2, 3] = -3.396" in str(e.value)
    one_bucket = str(e.value)
    with pytest.raises(ValueError, match="2 master weight") as e:
        next(iter(export(model, plan, bucket_bytes=1 << 16)))
    assert sorted(str(e.value).split("; ")) == sorted(one_bucket.split("; "))
    with pytest.raises(ValueError, match=rf"{name}: finite, but 1 value\(s\) past torch.bfloat16"):
        list(export_weights(model.named_parameters(), plan))


def test_the_masters_check_narrows_as_the_export_does():
    """A master of 70000 (finite in bf16, past fp16's 65504) is refused where the plan's bf16
    tensors are exported as fp16 and not as bf16; a tensor the export keeps in fp32 (a router
    bias) or quantizes may exceed bf16's range (its values are not cast to it)."""
    model = tiny(seed=4)
    plan = resolve("mxfp8", {n: p.shape for n, p in model.named_parameters()})
    params = dict(model.named_parameters())
    with torch.no_grad():
        params[NORM][1] = 70000.0
    with pytest.raises(ValueError, match=rf"{NORM}: finite, but 1 value\(s\) past torch.float16"):
        next(iter(export(model, plan, bucket_bytes=1 << 16, bf16_dtype=torch.float16)))
    with pytest.raises(ValueError, match=rf"{NORM}: finite, but 1 value\(s\) past torch.float16"):
        list(export_weights(model.named_parameters(), plan, bf16_dtype=torch.float16))
    assert check_finite(params, plan) == {}  # as bf16: finite
    quantized = next(n for n, s in plan.items() if s.format.value == "mxfp8")
    big = {quantized: torch.full((32, 64), 3.4e38)}  # bf16 would round it to Inf
    assert check_finite(big, plan) == {}  # quantized with its scales: not cast to bf16


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["bf16", "mxfp8", "fp8-block", "nvfp4-dequantized"])
def test_one_bucket_on_the_gpu_refuses_by_the_triton_quantizers_bytes(preset):
    """The Triton quantizers write 0x7F for a non-finite input too: the check of the codes on
    CUDA finds what the check of the masters finds, and a clean export is the same bytes."""
    model = tiny(seed=4).cuda()
    recipe = FP8_BLOCK_32 if preset == "fp8-block" else preset
    plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
    want = hashes(export_weights(model.named_parameters(), plan))
    assert hashes(export(model, plan, bucket_bytes=WHOLE_UPDATE).records()) == want
    # the backend asked for is checked against the masters' device (triton runs on CUDA)
    assert hashes(export(model, plan, backend="triton").records()) == want
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, index in BAD_PLACES.items():
            params[name][index] = math.nan
    exp = export(model, plan, bucket_bytes=WHOLE_UPDATE, sqnr=False)
    with pytest.raises(ValueError, match="refusing to export: 3 master weight") as err:
        next(iter(exp))
    assert "experts.1.down_proj.weight[2, 3] = nan" in str(err.value)


def test_quantizers_wait_for_the_amaxes_they_read_and_no_others(monkeypatch):
    """`quantized_values` orders each NVFP4 tensor's quantizer after the check's amaxes on the
    master's device (`ready`), and no other tensor's (theirs read no amax)."""
    from mxrl.weights import finite

    model = tiny(seed=4)
    plan = resolve("nvfp4-dequantized", {n: p.shape for n, p in model.named_parameters()})
    calls = []
    real = finite.FiniteCheck.ready
    monkeypatch.setattr(
        finite.FiniteCheck, "ready", lambda self, device: calls.append(device) or real(self, device)
    )
    exp = export(model, plan, bucket_bytes=10**9, sqnr=False)  # the masters' check
    calls.clear()  # (its flags, built at once on this stream, waited for nothing)
    list(exp)
    nvfp4 = [n for n, s in plan.items() if s.format.value == "nvfp4"]
    assert nvfp4 and calls == [torch.device("cpu")] * len(nvfp4)


def test_values_are_added_before_the_verdict_and_only_when_checked_on_values():
    plan = resolve(ALL_NVFP4, {GATE: (64, 64), UP: (64, 64), NORM: (64,)})
    tensors = {GATE: torch.ones(64, 64), UP: torch.ones(64, 64), NORM: torch.ones(64)}
    masters = FiniteCheck(tensors, plan)
    with pytest.raises(AssertionError, match=r"^add\(\) takes values before result\(\)$"):
        masters.add(NORM, tensors[NORM].bfloat16())
    values = FiniteCheck(tensors, plan, on_values=True)
    values.add(NORM, tensors[NORM].bfloat16())
    values.add(GATE, "an NVFP4 value: checked by its master's amax, never read here")
    assert values.result() is values.amaxes
    with pytest.raises(AssertionError, match=r"^add\(\) takes values before result\(\)$"):
        values.add(NORM, tensors[NORM].bfloat16())


def test_a_device_holding_only_codes_is_checked_by_them():
    """No min, max or amax on the device: its flags are the codes' alone."""
    from mxrl.formats import Format, quantize

    w = torch.ones(64, 64)
    check = FiniteCheck({"w": w}, on_values=True)
    check.add("w", quantize(w, Format.MXFP8))
    assert check.result() == {}
    w[5, 7] = math.inf
    check = FiniteCheck({"w": w}, on_values=True)
    check.add("w", quantize(w, Format.MXFP8))
    with pytest.raises(ValueError, match=r"w: 1 non-finite, first w\[5, 7\] = inf"):
        check.result()
    with pytest.raises(ValueError, match="a nvfp4 value is checked on its master"):
        FiniteCheck({"w": w}, on_values=True).add("w", quantize(w, Format.NVFP4))


@pytest.mark.gpu
def test_masters_on_two_devices_are_checked_each_on_its_own():
    """Probes are grouped by their tensor's device: one flag read per device, and a bad tensor
    found on either."""
    cpu, gpu = torch.ones(8, 8), torch.ones(8, 8, device="cuda")
    assert check_finite({"a": cpu, "b": gpu}) == {}
    gpu[1, 2] = math.nan
    with pytest.raises(ValueError, match=r"1 master weight\(s\) hold NaN/Inf: b: 1 non-finite"):
        check_finite({"a": cpu, "b": gpu})


def test_a_quantizers_counts_are_read_instead_of_the_codes():
    """parts given (`quantize_measured`): the verdict is their third column's. A master with an
    Inf whose value's codes are clean is refused by a count of 1; a clean master whose codes
    hold 0x7F passes on counts of 0 (neither could happen from one quantizer: each shows
    which of the two the check read)."""
    from mxrl.formats import Format, quantize

    w = torch.ones(64, 64)
    clean = quantize(w, Format.MXFP8)
    counts = torch.zeros(2, 4, 3)
    counts[1, 2, 2] = 1.0
    bad_master = w.clone()
    bad_master[5, 7] = math.inf
    check = FiniteCheck({"w": bad_master}, on_values=True)
    check.add("w", clean, counts)
    with pytest.raises(ValueError, match=r"w: 1 non-finite, first w\[5, 7\] = inf"):
        check.result()
    bad_codes = quantize(bad_master, Format.MXFP8)
    assert (bad_codes.qdata == 0x7F).any()
    check = FiniteCheck({"w": w}, on_values=True)
    check.add("w", bad_codes, torch.zeros(2, 4, 3))
    assert check.result() == {}


@interpreter
@pytest.mark.parametrize("preset", ["mxfp8", "fp8-block", "nvfp4-dequantized"])
@pytest.mark.parametrize("sqnr", [False, True])
def test_one_bucket_on_the_triton_quantizers_refuses_by_their_counts(preset, sqnr):
    """The Triton quantizers (the interpreter standing in for a GPU) count the non-finite
    elements they read: on one bucket the check reads those counts, not the codes (no int8
    amax), and refuses with the masters' check's message; a clean export is the same bytes."""
    model = tiny(seed=4)
    recipe = FP8_BLOCK_32 if preset == "fp8-block" else preset
    plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
    want = hashes(export_weights(model.named_parameters(), plan))
    with Reads() as reads:
        got = export(model, plan, bucket_bytes=WHOLE_UPDATE, sqnr=sqnr, backend="triton")
        assert hashes(got.records()) == want
    assert reads.seen[("amax", torch.int8)] == 0  # no codes read
    one, many = refusals(
        model, plan, math.nan, {"bucket_bytes": WHOLE_UPDATE, "sqnr": sqnr, "backend": "triton"},
        {"bucket_bytes": 1 << 16, "sqnr": sqnr, "backend": "reference"},
    )  # fmt: skip
    assert one == many  # the same tensors, counts and first elements


@pytest.mark.parametrize("preset", ["mxfp8", "fp8-block"])
def test_one_bucket_reads_the_counts_its_quantizers_measured(preset, monkeypatch):
    """Where the quantizer measures (`quantize_measured` returns parts, here a CPU stand-in
    counting from the definitions), one bucket's check reads its counts: no int8 amax over
    the codes, and the refusal of NaN masters is the masters' check's."""
    import importlib

    from tests.weights.test_sqnr_sample import measuring_quantizer

    model = tiny(seed=4)
    recipe = FP8_BLOCK_32 if preset == "fp8-block" else preset
    plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
    want = hashes(export_weights(model.named_parameters(), plan))
    module = importlib.import_module("mxrl.weights.export")
    monkeypatch.setattr(module, "quantize_measured", measuring_quantizer([]))
    with Reads() as reads:
        assert hashes(export(model, plan, bucket_bytes=WHOLE_UPDATE, sqnr=False).records()) == want
    assert reads.seen[("amax", torch.int8)] == 0
    one, many = refusals(
        model, plan, math.nan, {"bucket_bytes": WHOLE_UPDATE, "sqnr": False},
        {"bucket_bytes": 1 << 16, "sqnr": False},
    )  # fmt: skip
    assert one == many
