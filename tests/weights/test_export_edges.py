"""Edges of the one export path (mxrl/weights/export.py), from the mutation run (issue 33,
docs/mutation/weights.export.md), on hand-made tensors and plans resolved for a few names (no
model built): the name and NaN/Inf checks (what they skip, what they return), the global amax
of a fuse pair, the fuse partners, fp32 router biases, the backend chosen once per device and
the reference for block sizes the kernels lack, and `quantize_tensor` on a worked MXFP8 example."""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch

from mxrl.formats import QTensor
from mxrl.kernels import Backend
from mxrl.recipe import Plan, resolve
from mxrl.weights import export_weights, quantized_values
from mxrl.weights.event import QuantizationEvent, SqnrMeter, SqnrSample
from mxrl.weights.export import check_finite, check_names, fuse_partners, quantize_tensor
from mxrl.weights.record import stored_tensors
from tests.sync.helpers import ALL_NVFP4, FP8_BLOCK_32, tiny

export_module = importlib.import_module("mxrl.weights.export")  # the module, not the function

Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"
BIAS = "model.layers.0.mlp.gate.e_score_correction_bias"  # DeepSeek's router bias: fp32
LAST = "model.layers.1.self_attn.q_proj.weight"  # bf16 (the last 15% of layers)
GATE = "model.layers.0.mlp.shared_expert.gate_proj.weight"
UP = "model.layers.0.mlp.shared_expert.up_proj.weight"
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"


def plan_of(shapes, recipe="mxfp8") -> Plan:
    return resolve(recipe, shapes)


def test_names_only_in_the_weights_are_refused_and_the_message_says_what_checked():
    plan = plan_of({Q: (64, 64), LAST: (64, 64)})
    weights = {Q: torch.ones(64, 64), LAST: torch.ones(64, 64)}
    check_names(weights, plan)  # the same names: nothing to say
    with pytest.raises(ValueError, match=r"^export: the plan .* not in the plan \['extra'\] \(1\)"):
        check_names({**weights, "extra": torch.ones(1)}, plan)
    with pytest.raises(ValueError, match=r"^export: .* missing \['model\.layers\.1\."):
        check_names({Q: weights[Q]}, plan)
    with pytest.raises(ValueError, match=r"^convert: the plan"):
        check_names({Q: weights[Q]}, plan, "convert")


def test_empty_and_integer_tensors_are_not_read_and_nothing_checked_returns_no_amax():
    # an empty float tensor has no min or max (aminmax refuses it): it must be skipped
    assert check_finite({"empty": torch.empty(0, 3), "ints": torch.tensor([1, 2])}) == {}
    assert check_finite({}) == {}
    assert check_finite({"empty": torch.empty(0)}, plan_of({Q: (64, 64)})) == {}


def test_only_nvfp4_tensors_of_the_plans_shape_get_their_amax_back():
    plan = plan_of({GATE: (64, 64), UP: (64, 64), DOWN: (4, 64, 64), NORM: (64,)}, ALL_NVFP4)
    gate = torch.zeros(64, 64)
    gate[3, 5] = -7.5  # the infinity norm: 7.5
    up = torch.full((64, 64), 0.25)
    down = torch.zeros(4, 64, 64)
    down[:, 0, 0] = torch.tensor([1.0, -2.0, 3.0, 0.5])  # one amax per expert
    norm = torch.full((64,), 9.0)  # bf16 under the plan: checked, no amax
    amaxes = check_finite({GATE: gate, UP: up, DOWN: down, NORM: norm}, plan)
    assert sorted(amaxes) == sorted([GATE, UP, DOWN])
    assert float(amaxes[GATE]) == 7.5 and float(amaxes[UP]) == 0.25
    assert amaxes[DOWN].reshape(-1).tolist() == [1.0, 2.0, 3.0, 0.5]
    # a tensor of another shape than the plan's is checked the plain way and gets no amax
    assert check_finite({GATE: torch.ones(32, 64)}, plan) == {}
    assert check_finite({GATE: gate}) == {}  # no plan: no amax


def test_a_bad_tensor_is_named_with_its_count_first_index_and_value():
    """+inf alone leaves the tensor's minimum finite, -inf alone its maximum: either is bad."""
    high, low, both = torch.zeros(3, 4), torch.zeros(5), torch.zeros(2, 2)
    high[1, 2], low[3] = math.inf, -math.inf
    both[0, 1], both[1, 0] = math.nan, math.inf
    ok = torch.ones(5)
    with pytest.raises(ValueError, match="refusing to export: 3 master") as err:
        check_finite({"a.weight": ok, "b.weight": high, "c.weight": low, "d.weight": both})
    msg = str(err.value)
    assert "b.weight: 1 non-finite, first b.weight[1, 2] = inf" in msg
    assert "c.weight: 1 non-finite, first c.weight[3] = -inf" in msg
    assert "d.weight: 2 non-finite, first d.weight[0, 1] = nan" in msg
    assert "a.weight" not in msg


def test_the_global_amax_of_a_2d_fuse_pair_is_the_larger_and_a_3d_tensor_keeps_its_own():
    amax = export_module._global_amax
    w2, w3 = torch.zeros(2, 2), torch.zeros(2, 2, 2)
    a, b = torch.tensor(2.0), torch.tensor(5.0)
    per_expert = torch.tensor([1.0, 4.0]).view(2, 1, 1)
    assert amax("a", w2, None, {"b": b}) is None  # the check kept none: the quantizer's
    assert amax("a", w2, None, {"a": a}) is a  # no partner: its own
    assert float(amax("a", w2, "b", {"a": a, "b": b})) == 5.0
    assert float(amax("b", w2, "a", {"a": a, "b": b})) == 5.0
    assert amax("a", w2, "b", {"a": a}) is None  # the partner's not kept: the quantizer's
    assert amax("a", w2, "b", {"a": a, "b": per_expert}) is None  # not one value: no max
    assert amax("e", w3, "f", {"e": per_expert, "f": a}) is per_expert


def test_fuse_partners_pair_two_member_groups_only():
    shapes = {GATE: (64, 64), UP: (64, 64), GATE_UP: (4, 128, 64), DOWN: (4, 64, 64)}
    plan = plan_of(shapes, ALL_NVFP4)
    assert plan[GATE_UP].fuse_group == GATE_UP  # a fused 3-D tensor is its own group
    assert fuse_partners(plan) == {GATE: UP, UP: GATE}
    assert fuse_partners(plan_of({Q: (64, 64), LAST: (64, 64)})) == {}  # two without a group
    # a group of one (its partner bf16, say) or of three has no pair
    alone = [dataclasses.replace(s, fuse_group="g1") if n == GATE else s for n, s in plan.items()]
    lone = dataclasses.replace(plan, specs=[s for s in alone if s.name != UP])
    assert fuse_partners(lone) == {}
    down = dataclasses.replace(plan[DOWN], fuse_group=plan[GATE].fuse_group)
    three = dataclasses.replace(plan, specs=[s if s.name != DOWN else down for s in plan.values()])
    assert fuse_partners(three) == {}


def test_an_fp32_router_bias_stays_fp32_and_the_rest_take_the_bf16_dtype():
    plan = plan_of({Q: (64, 64), BIAS: (8,), NORM: (64,), LAST: (64, 64)})
    g = torch.Generator().manual_seed(1)
    w = {n: torch.randn(plan[n].shape, generator=g) for n in plan}
    for dtype in (torch.bfloat16, torch.float16):
        values = dict(quantized_values(w, plan, bf16_dtype=dtype))
        assert values[BIAS].dtype == torch.float32 and torch.equal(values[BIAS], w[BIAS])
        assert values[BIAS].data_ptr() != w[BIAS].data_ptr()  # a copy, even in its own dtype
        assert values[NORM].dtype == values[LAST].dtype == dtype
        assert torch.equal(values[LAST], w[LAST].to(dtype))
        assert isinstance(values[Q], QTensor)


class _Calls:
    """Stand-ins for the export's backend choice (as a CUDA device would choose: triton) and its
    quantizer (records the backend, then quantizes with the reference)."""

    def __init__(self, monkeypatch):
        self.chosen: list[tuple[object, torch.device]] = []
        self.quantized: list[tuple[str, Backend]] = []
        real = export_module.kernel_quantize

        def backend_for(backend, device):
            self.chosen.append((backend, device))
            return Backend.TRITON

        def kernel_quantize(w, fmt, *, backend, **kwargs):
            self.quantized.append((str(fmt), backend))
            return real(w, fmt, **kwargs, backend=Backend.REFERENCE)

        monkeypatch.setattr(export_module, "backend_for", backend_for)
        monkeypatch.setattr(export_module, "kernel_quantize", kernel_quantize)


def test_the_backend_is_chosen_once_per_device_with_the_callers_request(monkeypatch):
    calls = _Calls(monkeypatch)
    plan = plan_of({Q: (64, 64), K: (64, 64), NORM: (64,), LAST: (64, 64)})
    w = {n: torch.ones(plan[n].shape) for n in plan}
    values = dict(quantized_values(w, plan, backend="reference"))
    assert calls.chosen == [("reference", torch.device("cpu"))]  # two quantized, one choice
    assert calls.quantized == [("mxfp8", Backend.TRITON), ("mxfp8", Backend.TRITON)]
    assert sorted(n for n, v in values.items() if isinstance(v, QTensor)) == sorted([Q, K])


def test_export_weights_passes_its_dtype_and_backend_on(monkeypatch):
    calls = _Calls(monkeypatch)
    plan = plan_of({Q: (64, 64), NORM: (64,), LAST: (64, 64)})
    w = {n: torch.ones(plan[n].shape) for n in plan}
    records = export_weights(w, plan, bf16_dtype=torch.float16, backend="reference")
    values = {r.name: r.value for r in records}
    assert calls.chosen == [("reference", torch.device("cpu"))]
    assert values[NORM].dtype == values[LAST].dtype == torch.float16


def test_a_partner_not_of_the_plans_shape_still_sets_the_first_tensors_global_scale():
    """The check keeps no amax for a master of another shape than the plan's: the gate's global
    amax is then the quantizer's own max over gate (1) and up (6), a global scale of
    448 * 6 / 6 = 448 (not 448 * 6 / 1 = 2688); the up tensor is refused when its turn comes."""
    plan = plan_of({GATE: (64, 64), UP: (64, 64)}, ALL_NVFP4)
    values = quantized_values({GATE: torch.ones(64, 64), UP: torch.full((64, 32), 6.0)}, plan)
    name, gate = next(values)
    assert name == GATE and float(gate.global_scale) == 448.0
    with pytest.raises(ValueError, match=r"up_proj\.weight: the plan says shape \(64, 64\)"):
        next(values)


@pytest.mark.parametrize(
    ("block", "want"), [((32, 32), Backend.TRITON), ((48, 48), Backend.REFERENCE)]
)
def test_block_fp8_of_a_block_the_kernels_lack_takes_the_reference(monkeypatch, block, want):
    """The kernels take block widths 16, 32, 64 and 128 (mxrl.kernels.api): a 48-wide block is
    quantized by the reference whatever backend was chosen."""
    calls = _Calls(monkeypatch)
    recipe = {**FP8_BLOCK_32, "rules": [{**FP8_BLOCK_32["rules"][1], "block": list(block)}]}
    plan = plan_of({Q: (96, 96), LAST: (96, 96)}, recipe)
    assert plan[Q].block == block
    dict(quantized_values({Q: torch.ones(96, 96), LAST: torch.ones(96, 96)}, plan))
    assert calls.quantized == [("fp8_block", want), ("fp8_block", want)]
    calls.quantized.clear()
    quantize_tensor(torch.ones(96, 96), plan[Q], backend="triton")
    assert calls.quantized == [("fp8_block", want)]
    assert calls.chosen[-1] == ("triton", torch.device("cpu"))


def test_quantize_tensor_gives_the_worked_mxfp8_bytes():
    """Rows of 32 ones and 32 threes: the E8M0 scales 2^-8 (code 127 - 8 = 119) and 2^-7
    (code 120) put the values at 256 = 2^8 (E4M3 0 1111 000 = 120) and 384 = 1.5 * 2^8
    (0 1111 100 = 124)."""
    plan = plan_of({Q: (2, 32), LAST: (2, 32)})
    value = quantize_tensor(torch.tensor([[1.0] * 32, [3.0] * 32]), plan[Q])
    assert (value.fmt.value, value.shape, value.axis) == ("mxfp8", (2, 32), -1)
    assert value.qdata.tolist() == [[120] * 32, [124] * 32]
    assert value.scale.view(torch.uint8).tolist() == [[119], [120]]


def test_quantize_tensor_copies_bf16_contiguously_and_refuses_nvfp4():
    plan = plan_of({Q: (64, 64), LAST: (64, 64)})
    master = torch.arange(64 * 64, dtype=torch.bfloat16).view(64, 64).t()  # column-major
    value = quantize_tensor(master, plan[LAST])
    assert value.dtype == torch.bfloat16 and value.is_contiguous()
    assert value.data_ptr() != master.data_ptr() and torch.equal(value, master)
    fp32 = quantize_tensor(torch.full((64, 64), 1.5), plan[LAST])
    assert fp32.dtype == torch.bfloat16 and bool((fp32 == 1.5).all())
    nvfp4 = plan_of({GATE: (64, 64), UP: (64, 64)}, ALL_NVFP4)
    with pytest.raises(ValueError, match="does not take NVFP4"):
        quantize_tensor(torch.ones(64, 64), nvfp4[GATE])


# --- the quantization event and the SQNR meter (mxrl/weights/event.py) ------------------------


def test_the_events_dict_spells_out_every_non_finite_sqnr_and_reads_back_without_one():
    sqnr = {"layer.0": -math.inf, "layer.1": math.nan, "layer.2": 12.5}
    d = QuantizationEvent(2, "h", 3, 40, 0.25, sqnr).to_dict()
    assert d == {
        "step": 2, "plan_hash": "h", "num_tensors": 3, "num_bytes": 40, "seconds": 0.25,
        "sqnr_db": {"layer.0": "-inf", "layer.1": "nan", "layer.2": 12.5},
    }  # fmt: skip
    assert type(d["sqnr_db"]["layer.2"]) is float  # a finite SQNR stays a JSON number
    back = QuantizationEvent.from_dict({**d, "sqnr_db": {"layer.0": "-inf", "other": 12}})
    assert back.sqnr_db == {"layer.0": -math.inf, "other": 12.0}
    assert type(back.sqnr_db["other"]) is float
    # JSON may give numbers as other types; a dict without sqnr_db is an event without any
    plain = QuantizationEvent.from_dict(
        {"step": "4", "plan_hash": "h", "num_tensors": 2.0, "num_bytes": "10", "seconds": 1}
    )
    assert plain == QuantizationEvent(4, "h", 2, 10, 1.0, {})
    assert [type(v) for v in (plain.step, plain.num_tensors, plain.num_bytes, plain.seconds)] == [
        int, int, int, float,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "args", [(True,), (1.0,), (0,), (-2,), ("2",), (2, True), (2, 1.0), (2, -1), (2, "0")]
)
def test_a_sample_refuses_strides_and_phases_that_are_not_ints_in_range(args):
    with pytest.raises(ValueError, match="stride" if len(args) == 1 else "phase"):
        SqnrSample(*args)


def test_the_smallest_sample_and_an_exports_sqnr_argument():
    assert (SqnrSample(1, 0).stride, SqnrSample(1, 0).phase) == (1, 0)
    assert SqnrSample() == SqnrSample(1, 0)
    assert SqnrSample.at_step(9, 4) == SqnrSample(4, 1)
    assert SqnrSample.of(True) == SqnrSample(1, 0) and SqnrSample.of(False) is None
    sample = SqnrSample(3, 2)
    assert SqnrSample.of(sample) is sample
    assert SqnrMeter().sample == SqnrSample(1, 0)
    assert SqnrMeter(sample).sample is sample


def mxfp8_ones(*shape: int, axis: int = -1) -> QTensor:
    """An MXFP8 QTensor whose every element is 1.0: E4M3 0 0111 000 (56) at scale 2^0 (E8M0
    code 127), one scale per 32 elements along `axis`."""
    scale_shape = list(shape)
    scale_shape[axis] //= 32
    scale = torch.full(scale_shape, 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return QTensor(torch.full(shape, 56, dtype=torch.uint8), scale, "mxfp8", shape, axis)


def test_the_meter_sums_per_layer_and_orders_layers_by_number_then_other():
    """Masters of 32 twos against ones: signal 32 * 4, noise 32 * 1, 10 log10(4) dB; ones
    against ones: no noise, +inf; zeros against ones: no signal, -inf."""
    meter = SqnrMeter()
    meter.add(None, torch.zeros(1, 32), mxfp8_ones(1, 32))
    meter.add(10, torch.full((1, 32), 2.0), mxfp8_ones(1, 32))
    meter.add(2, torch.ones(1, 32), mxfp8_ones(1, 32))
    out = meter.result()
    assert list(out) == ["layer.2", "layer.10", "other"]
    assert out["layer.2"] == math.inf and out["other"] == -math.inf
    assert out["layer.10"] == pytest.approx(10 * math.log10(4), rel=1e-12)
    meter.add(10, torch.ones(1, 32), mxfp8_ones(1, 32))  # signal 128 + 32, noise 32 + 0
    assert meter.result()["layer.10"] == pytest.approx(10 * math.log10(5), rel=1e-12)
    assert SqnrMeter().result() == {}


def stack() -> torch.Tensor:
    """Two experts of 32 values each: expert 0 all twos, expert 1 all threes (against ones:
    expert 0 signal 128 noise 32, expert 1 signal 288 noise 128)."""
    return torch.tensor([2.0, 3.0]).view(2, 1, 1).expand(2, 1, 32).contiguous()


@pytest.mark.parametrize("axis", [-1, 2])
def test_a_stack_blocked_along_its_last_dim_counts_the_samples_experts(axis):
    for sample, ratio in [(SqnrSample(2, 0), 128 / 32), (SqnrSample(2, 1), 288 / 128),
                          (SqnrSample(1, 0), 416 / 160)]:  # fmt: skip
        meter = SqnrMeter(sample)
        meter.add(0, stack(), mxfp8_ones(2, 1, 32, axis=axis))
        assert meter.result() == {"layer.0": pytest.approx(10 * math.log10(ratio), rel=1e-12)}


def test_a_stack_blocked_along_another_dim_is_measured_whole():
    master = stack().transpose(1, 2).contiguous()  # [2, 32, 1], blocks along dim 1
    meter = SqnrMeter(SqnrSample(2, 1))
    meter.add(0, master, mxfp8_ones(2, 32, 1, axis=1))
    assert meter.result() == {"layer.0": pytest.approx(10 * math.log10(416 / 160), rel=1e-12)}


def test_a_shard_counts_by_its_global_experts_and_one_without_any_adds_no_key():
    shard, q = stack()[1:], mxfp8_ones(1, 1, 32)  # global expert 1 of 2
    meter = SqnrMeter(SqnrSample(2, 1))
    meter.add(0, shard, q, first=1, total=2)
    assert meter.result() == {"layer.0": pytest.approx(10 * math.log10(288 / 128), rel=1e-12)}
    meter = SqnrMeter(SqnrSample(2, 0))
    meter.add(0, shard, q, first=1, total=2)  # expert 1 is in group 1, not 0
    assert meter.result() == {}
    meter.add(0, shard, q)  # alone (one expert of one): always measured
    assert meter.result() == {"layer.0": pytest.approx(10 * math.log10(288 / 128), rel=1e-12)}


@pytest.mark.gpu
def test_layers_measured_on_two_devices_are_read_back_together():
    """One host read for every layer: the sums are gathered on the first layer's device (a
    layer on the CPU, one on the GPU; the same hand-worked ratios as above)."""
    meter = SqnrMeter()
    meter.add(0, torch.full((1, 32), 2.0), mxfp8_ones(1, 32))
    meter.add(1, torch.full((1, 32), 2.0, device="cuda"), mxfp8_ones(1, 32).to("cuda"))
    want = pytest.approx(10 * math.log10(4), rel=1e-12)
    assert meter.result() == {"layer.0": want, "layer.1": want}
    # and a quantizer's parts (signal 4, noise 1; a count column) on each device
    for layer, device in ((2, "cpu"), (3, "cuda")):
        parts = torch.tensor([[[3.0, 1.0, 0.0], [1.0, 0.0, 0.0]]], device=device)
        meter.add(
            layer, torch.ones(1, 32, device=device), mxfp8_ones(1, 32).to(device), parts=parts
        )
    assert meter.result() == {f"layer.{i}": want for i in range(4)}


def test_the_finite_check_launches_one_read_per_tensor_and_one_check_for_all():
    # every op but the per-tensor read (aminmax) is the same count for 2 tensors as for 7: the
    # flags are one isfinite over all the tensors' min/max and one host read (each op is a
    # kernel launch on a GPU: the loop's sync checks every master tensor each step)
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    def ops(n):
        tensors = {f"w{i}": torch.randn(4, 8) for i in range(n)}
        tensors["b"] = torch.randn(3, dtype=torch.bfloat16)
        with Count() as count:
            assert check_finite(tensors) == {}
        return count.ops

    few, many = ops(2), ops(7)
    assert (few["aminmax"], many["aminmax"]) == (3, 8)
    assert {k: v for k, v in few.items() if k != "aminmax"} == {
        k: v for k, v in many.items() if k != "aminmax"
    }
    assert many["cat"] == 1


@pytest.mark.parametrize("bad", [None, (0, 0), (63, 63)])
def test_a_device_holding_only_nvfp4_tensors_is_checked_by_their_amaxes(bad):
    """Every tensor the plan makes NVFP4: no min/max probe on that device, its amaxes alone are
    the check (read from their own start), and a NaN in the first or the last element is found."""
    plan = plan_of({GATE: (64, 64), UP: (64, 64)}, ALL_NVFP4)
    gate, up = torch.ones(64, 64), torch.full((64, 64), 0.5)
    if bad is not None:
        up[bad] = math.nan
    if bad is None:
        amaxes = check_finite({GATE: gate, UP: up}, plan)
        assert float(amaxes[GATE]) == 1.0 and float(amaxes[UP]) == 0.5
        return
    with pytest.raises(ValueError, match=rf"{UP}: 1 non-finite") as err:
        check_finite({GATE: gate, UP: up}, plan)
    assert GATE not in str(err.value)


def test_exported_values_carry_no_autograd_history():
    """The masters are parameters autograd tracks; what the export hands on (bf16 copies,
    QTensor fields) and the amaxes its check returns are plain tensors, detached once."""
    model = tiny(seed=0)
    assert all(p.requires_grad for p in model.parameters())
    plan = resolve("nvfp4-dequantized", {n: p.shape for n, p in model.named_parameters()})
    values = dict(quantized_values(model.named_parameters(), plan))
    assert any(isinstance(v, torch.Tensor) for v in values.values())  # bf16 ones too
    for name, value in values.items():
        for t in (value,) if isinstance(value, torch.Tensor) else stored_tensors(value).values():
            assert not t.requires_grad, name
    amaxes = check_finite(dict(model.named_parameters()), plan)
    assert amaxes and not any(a.requires_grad for a in amaxes.values())
