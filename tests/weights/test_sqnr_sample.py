"""The sampled per-layer SQNR the GRPO loop measures each step (mxrl/weights/event.py): which
experts a `SqnrSample` takes, worked out by hand, and the sums over exactly those experts."""

import importlib
import math

import pytest
import torch

from mxrl.formats import QTensor, dequantize, quantize
from mxrl.kernels import Backend
from mxrl.recipe import resolve
from mxrl.weights import WHOLE_UPDATE, export
from mxrl.weights.event import SqnrMeter, SqnrSample
from tests.kernels.test_decode_gemm import interpreter
from tests.sync.helpers import FP8_BLOCK_32, tiny
from tests.weights.test_export_edges import mxfp8_ones


@pytest.mark.parametrize(
    ("stride", "phase", "first", "count", "total", "want"),
    [
        (1, 0, 0, 6, 6, None),  # every expert
        (2, 1, 0, 5, 5, [3, 4]),  # groups floor(2e / 5): 0 0 0 1 1
        (2, 0, 0, 5, 5, [0, 1, 2]),
        (4, 6, 0, 9, 9, [5, 6]),  # the phase wraps (6 mod 4); floor(4e / 9): 0 0 0 1 1 2 2 3 3
        (16, 7, 0, 5, 5, [2]),  # fewer experts than the stride: s = 5, 7 mod 5
        (16, 0, 0, 1, 1, None),  # one expert: always measured
        (2, 1, 3, 2, 5, [0, 1]),  # a shard holding global experts 3, 4 (group 1)
        (3, 1, 4, 4, 8, [0, 1]),  # global 4..7; floor(3e / 8): group 1 is 3, 4, 5
        (4, 2, 8, 3, 11, [0]),  # global 8..10; floor(4e / 11): group 2 is 6, 7, 8
        (4, 3, 8, 3, 11, [1, 2]),  # group 3 is 9, 10
        (4, 1, 8, 3, 11, []),  # group 1 (3, 4, 5): no expert of this shard
    ],
)
def test_the_experts_a_sample_measures(stride, phase, first, count, total, want):
    assert SqnrSample(stride, phase).experts(first, count, total) == want


def test_the_loop_sample_moves_one_expert_a_step():
    assert [SqnrSample.at_step(s, 4).phase for s in range(1, 10)] == [1, 2, 3, 0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="stride"):
        SqnrSample(0)
    with pytest.raises(ValueError, match="phase"):
        SqnrSample(2, -1)


def _db(master: torch.Tensor, q: QTensor, experts: list[int]) -> float:
    """SQNR over `experts` of a 3-D stack, in float64 from the dequantized values."""
    ref = master.double()[experts]
    err = ref - dequantize(q).double()[experts]
    return 10 * math.log10(float((ref * ref).sum()) / float((err * err).sum()))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8_block"])
def test_a_sampled_stack_counts_only_its_experts(fmt):
    g = torch.Generator().manual_seed(3)
    # each expert its own magnitude, so a wrong expert changes the value
    master = torch.randn(5, 128, 128, generator=g) * torch.arange(1, 6).view(5, 1, 1)
    master[2] += torch.randn(128, 128, generator=g) * 40  # an outlier expert
    q = quantize(master, fmt)
    for stride, phase, experts in [(2, 1, [3, 4]), (2, 0, [0, 1, 2]), (16, 7, [2]), (1, 0, None)]:
        meter = SqnrMeter(SqnrSample(stride, phase))
        meter.add(0, master, q)
        want = _db(master, q, experts if experts is not None else list(range(5)))
        assert meter.result()["layer.0"] == pytest.approx(want, rel=1e-9), (stride, phase)


def test_shards_of_a_stack_add_up_to_the_whole_stacks_sample():
    """Two shards (torch.chunk of 5 experts over 2 ranks: 3 + 2) measured with their global
    offsets give the sample of the whole stack."""
    g = torch.Generator().manual_seed(4)
    master = torch.randn(5, 64, 64, generator=g) * torch.arange(1, 6).view(5, 1, 1)
    sample = SqnrSample(3, 1)  # floor(3e / 5) = 0 0 1 1 2: experts 2 and 3, one in each shard
    meter = SqnrMeter(sample)
    for first, stop in [(0, 3), (3, 5)]:
        part = master[first:stop]
        meter.add(0, part, quantize(part, "mxfp8"), first=first, total=5)
    assert meter.result()["layer.0"] == pytest.approx(
        _db(master, quantize(master, "mxfp8"), [2, 3]), rel=1e-9
    )


def test_2d_tensors_are_always_measured_whole():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=g)
    q = quantize(w, "mxfp8")
    meter = SqnrMeter(SqnrSample(16, 3))
    meter.add(None, w, q)
    ref, err = w.double(), w.double() - dequantize(q).double()
    want = 10 * math.log10(float((ref * ref).sum()) / float((err * err).sum()))
    assert meter.result()["other"] == pytest.approx(want, rel=1e-9)


def test_an_export_with_a_sample_measures_the_sampled_experts():
    """export(..., sqnr=SqnrSample) on a model: each layer's SQNR from its 2-D quantized
    tensors whole and its expert stacks' sampled experts."""
    model = tiny()
    plan = resolve("nvfp4-dequantized", {n: p.shape for n, p in model.named_parameters()})
    sample = SqnrSample(2, 1)
    exp = export(model, plan, sqnr=sample)
    records = {r.name: r.value for r in exp.records()}
    params = dict(model.named_parameters())
    signal = noise = 0.0
    for name, value in records.items():
        if plan[name].layer == 1 and isinstance(value, QTensor):
            ref, deq = params[name].detach().double(), dequantize(value).double()
            if ref.dim() == 3:
                n = ref.shape[0]
                keep = [e for e in range(n) if e * min(2, n) // n == 1]  # the second half
                ref, deq = ref[keep], deq[keep]
            signal += float((ref * ref).sum())
            noise += float(((ref - deq) ** 2).sum())
    assert exp.event.sqnr_db["layer.1"] == pytest.approx(10 * math.log10(signal / noise), rel=1e-9)


def _sums(w: torch.Tensor, q: QTensor) -> torch.Tensor:
    """[sum w^2, sum (w - dequantize(q))^2] in float64, written out."""
    err = w - dequantize(q)
    return torch.stack([w.double().square().sum(), err.double().square().sum()])


def test_the_meters_totals_add_each_layers_sums_in_order_and_can_be_replaced():
    """`totals` (what the sharded export all-reduces): each key's float64 sums added in the
    order the tensors were; `set_totals` replaces them, and `result` reads only those."""
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(8, 64, generator=g) for _ in range(3)]
    qs = [quantize(w, "mxfp8") for w in ws]
    meter = SqnrMeter()
    meter.add(0, ws[0], qs[0])
    meter.add(1, ws[1], qs[1])
    meter.add(0, ws[2], qs[2])
    totals = meter.totals()
    assert sorted(totals) == ["layer.0", "layer.1"]
    torch.testing.assert_close(totals["layer.0"], _sums(ws[0], qs[0]) + _sums(ws[2], qs[2]))
    torch.testing.assert_close(totals["layer.1"], _sums(ws[1], qs[1]))
    s, n = totals["layer.0"].tolist()
    assert meter.result()["layer.0"] == pytest.approx(10 * math.log10(s / n))
    meter.set_totals({"layer.3": torch.tensor([100.0, 1.0], dtype=torch.float64)})
    assert meter.result() == {"layer.3": pytest.approx(20.0)}


def _parts(*rows) -> torch.Tensor:
    """fp32 parts [G, P, 3] as a quantizer writes them, from per-group lists of (signal, noise)
    pairs; the third column (the check's non-finite count, not the meter's) is 7, so that
    reading it as a sum would show."""
    pairs = torch.tensor(rows, dtype=torch.float32)
    return torch.cat([pairs, torch.full((*pairs.shape[:-1], 1), 7.0)], dim=-1)


def test_a_quantizers_parts_are_taken_for_the_sampled_experts():
    """parts per expert (G = E: 3 experts, 2 parts each): the sample's experts' rows are
    summed, and the master is not read (it would give another value). SqnrSample(3, 1) on 3
    experts measures expert 1: signal 3 + 5 = 8, noise 1 + 1 = 2, 10 log10(4) dB."""
    master = torch.ones(3, 1, 32)  # against ones: no noise at all, +inf, if it were read
    q = mxfp8_ones(3, 1, 32)
    parts = _parts([[100.0, 1.0], [100.0, 1.0]], [[3.0, 1.0], [5.0, 1.0]], [[7.0, 9.0], [1.0, 1.0]])
    meter = SqnrMeter(SqnrSample(3, 1))
    meter.add(0, master, q, parts=parts)
    assert meter.result() == {"layer.0": pytest.approx(10 * math.log10(4), rel=1e-12)}
    whole = SqnrMeter()  # every expert: all six rows, signal 216, noise 14
    whole.add(0, master, q, parts=parts)
    assert whole.result() == {"layer.0": pytest.approx(10 * math.log10(216 / 14), rel=1e-12)}


def test_parts_not_per_expert_leave_a_sample_to_the_master():
    """parts of one group (a program crossing two experts) cannot give one expert's sums: the
    sample reads the master instead (+inf here: ones against ones). Measured whole, the parts
    are taken."""
    master, q = torch.ones(3, 1, 32), mxfp8_ones(3, 1, 32)
    parts = _parts([[4.0, 1.0], [4.0, 1.0], [2.0, 0.0]])
    sampled = SqnrMeter(SqnrSample(3, 1))
    sampled.add(0, master, q, parts=parts)
    assert sampled.result() == {"layer.0": math.inf}
    whole = SqnrMeter()
    whole.add(0, master, q, parts=parts)
    assert whole.result() == {"layer.0": pytest.approx(10 * math.log10(5), rel=1e-12)}


def test_parts_and_sums_of_one_layer_add_in_order_and_in_totals():
    """A layer measured both ways (a 2-D tensor's float64 sums: 32 x 4 signal, 32 noise; an
    expert stack's parts: 8 and 2) adds them; `totals` gives the same float64 sums, and the
    copies `queue` started are made again after another add."""
    meter = SqnrMeter()
    meter.add(2, torch.full((1, 32), 2.0), mxfp8_ones(1, 32))
    meter.add(
        2, torch.ones(2, 1, 32), mxfp8_ones(2, 1, 32), parts=_parts([[3.0, 1.0]], [[5.0, 1.0]])
    )
    meter.queue()
    assert meter.result() == {"layer.2": pytest.approx(10 * math.log10(136 / 34), rel=1e-12)}
    assert meter.totals()["layer.2"].tolist() == [136.0, 34.0]
    meter.add(None, torch.ones(1, 32), mxfp8_ones(1, 32), parts=_parts([[6.0, 2.0]]))
    out = meter.result()
    assert out["other"] == pytest.approx(10 * math.log10(3), rel=1e-12) and "layer.2" in out


@interpreter
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4-dequantized", FP8_BLOCK_32])
def test_the_quantizers_parts_give_the_references_sqnr(recipe, monkeypatch):
    """An export on the Triton quantizers (the interpreter standing in for a GPU) takes the
    SQNR's terms from them, reading no master again (`error_sums` is not called), and gives
    the reference export's bytes and per-layer SQNR (tile sums in fp32: a relative 1e-6 of
    each term, far below a printed dB)."""
    model = tiny()
    plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
    sample = SqnrSample(2, 1)
    want = export(model, plan, sqnr=sample, backend="reference")
    want_hashes = {r.name: r.hash for r in want.records()}

    def no_second_read(*args, **kwargs):
        raise AssertionError("error_sums read a master the quantizer had measured")

    monkeypatch.setattr("mxrl.weights.event.error_sums", no_second_read)
    got = export(model, plan, sqnr=sample, backend="triton")
    assert {r.name: r.hash for r in got.records()} == want_hashes
    assert set(got.event.sqnr_db) == set(want.event.sqnr_db) and got.event.sqnr_db
    for key, db in want.event.sqnr_db.items():
        assert got.event.sqnr_db[key] == pytest.approx(db, abs=1e-4), key


def test_parts_are_added_in_float64():
    """fp32 parts of 2^24 and two ones: float64 gives 2^24 + 2, fp32 additions 2^24 (each 1 is
    lost to rounding). The meter's result and totals keep the ones."""
    parts = _parts([[2.0**24, 1.0], [1.0, 0.0], [1.0, 0.0]])
    meter = SqnrMeter()
    meter.add(0, torch.ones(1, 32), mxfp8_ones(1, 32), parts=parts)
    assert meter.totals()["layer.0"].tolist() == [2.0**24 + 2, 1.0]
    assert meter.result()["layer.0"] == pytest.approx(10 * math.log10(2.0**24 + 2), rel=1e-12)
    assert meter.result()["layer.0"] != pytest.approx(10 * math.log10(2.0**24), rel=1e-12)


def measuring_quantizer(calls: list):
    """A stand-in for `quantize_measured` on the Triton kernels, on the CPU: the reference
    quantizer's value, and parts [G, 1, 3] per expert of a 3-D stack (one group otherwise) of
    (sum w^2, sum err^2, non-finite count) written from the definitions. Records the backend
    each call was given."""
    from mxrl.formats import dequantize
    from mxrl.kernels import quantize as kernel_quantize

    def measured(w, fmt, *, backend, **options):
        calls.append(backend)
        q = kernel_quantize(w, fmt, backend=backend, **options)
        groups = w.shape[0] if w.dim() == 3 else 1
        wd = w.double().reshape(groups, -1)
        err = wd - dequantize(q).double().reshape(groups, -1)
        bad = (~torch.isfinite(w)).reshape(groups, -1).sum(1).double()
        parts = torch.stack([wd.square().sum(1), err.square().sum(1), bad], dim=-1)
        return q, parts.float().reshape(groups, 1, 3)

    return measured


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4-dequantized", FP8_BLOCK_32])
def test_the_export_takes_the_sqnr_from_what_its_quantizers_measured(recipe, monkeypatch):
    """Where the quantizer measures (`quantize_measured` returns parts), the export's SQNR is
    added from its parts (error_sums never called) with the backend the export chose, and
    equals the SQNR measured by reading the masters again (fp32 parts: a relative 1e-7)."""
    model = tiny()
    plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
    sample = SqnrSample(2, 1)
    exp = export(model, plan, sqnr=sample)
    list(exp.records())
    want = exp.event.sqnr_db
    calls: list = []
    module = importlib.import_module("mxrl.weights.export")  # (mxrl.weights.export: a function)
    monkeypatch.setattr(module, "quantize_measured", measuring_quantizer(calls))

    def no_second_read(*args, **kwargs):
        raise AssertionError("error_sums read a master the quantizer had measured")

    monkeypatch.setattr("mxrl.weights.event.error_sums", no_second_read)
    exp = export(model, plan, sqnr=sample)
    list(exp.records())
    got = exp.event.sqnr_db
    assert set(got) == set(want) and got
    for key, db in want.items():
        assert got[key] == pytest.approx(db, abs=1e-5), key
    quantized = sum(1 for s in plan.values() if s.format.value != "bf16")
    assert calls == [Backend.REFERENCE] * quantized
    # nothing to measure (no SQNR, several buckets: the masters' check): the plain quantizer
    list(export(model, plan, sqnr=False, bucket_bytes=1 << 16).records())
    assert len(calls) == quantized
    # one bucket, no SQNR: measured for the check's counts
    list(export(model, plan, sqnr=False, bucket_bytes=WHOLE_UPDATE).records())
    assert len(calls) == 2 * quantized
