"""Edges of the layers that build quantized weights (mxrl/nn/qlinear.py: path_weight, QLinear,
QExperts), each expectation from mxrl.formats or worked out by hand: what each GEMM path holds,
block FP8's column copy for the FP8 tensor cores (reached on the CPU by standing in for
`uses_scaled_mm`), a fuse partner's in-place write, a 3-D input with a bias on exact small
integers, the experts' bf16 and quantized projections, and the reprs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import mxrl.nn.paths.grouped as grouped_path
import mxrl.nn.paths.reference as reference_path
import mxrl.nn.qlinear as qlinear
import mxrl.nn.weight as weight
from mxrl.formats import decode_global_scale, quantize
from mxrl.kernels import Backend, Gemm
from mxrl.nn import GroupedExperts, QExperts, QLinear, set_gemm
from mxrl.nn.paths.permute import ExpertLayout
from mxrl.nn.qlinear import path_weight
from mxrl.recipe import Backward
from tests.nn.test_qmatmul import _expert_specs, spec
from tests.numerics import assert_bytes_equal

F32 = "torch.float32"


def _w(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(*shape, generator=g) * 0.05)


@pytest.fixture
def scaled_mm(monkeypatch):
    """uses_scaled_mm as on a GPU with FP8 tensor cores; records what it is asked."""
    asked = []

    def stand_in(s, device):
        asked.append((s.name, device))
        return True

    monkeypatch.setattr(qlinear, "uses_scaled_mm", stand_in)
    return asked


def test_block_fp8_gets_a_column_copy_only_for_a_dense_quantized_tensor_core_gemm(scaled_mm):
    w = _w((128, 256))
    s = spec("fp8_block", shape=(128, 256))
    want = quantize(w.detach().t().contiguous(), "fp8_block", block=(128, 128))
    tc = path_weight(Gemm.TENSOR_CORE, w, s, None, Backward.QUANTIZED, Backend.REFERENCE)
    assert scaled_mm == [(s.name, w.device)]
    assert tc.held == {}  # made when the backward asks for it
    assert_bytes_equal(tc.col().qdata, want.qdata, "w^T codes")
    assert_bytes_equal(tc.col().scale, want.scale, "w^T scales")
    grouped = path_weight(
        Gemm.TENSOR_CORE, w, s, None, Backward.QUANTIZED, Backend.REFERENCE, grouped=True
    )
    assert grouped.col() is None  # routed experts read the forward's codes transposed
    deq = path_weight(Gemm.TENSOR_CORE, w, s, None, Backward.DEQUANTIZED, Backend.REFERENCE)
    assert deq.col() is None
    ref = path_weight(Gemm.REFERENCE, w, s, None, Backward.QUANTIZED, Backend.REFERENCE)
    assert sorted(ref.held) == [f"deq:{F32}", f"lp:{F32}"] and ref.col() is None


def test_without_fp8_tensor_cores_block_fp8_has_no_column_copy():
    w = _w((128, 256))
    s = spec("fp8_block", shape=(128, 256))
    tc = path_weight(Gemm.TENSOR_CORE, w, s, None, Backward.QUANTIZED, Backend.REFERENCE)
    assert tc.col() is None and tc.held == {}


@pytest.mark.parametrize("mode", list(Backward))
def test_mxfp8_holds_a_column_copy_only_for_the_quantized_backward(mode):
    w = _w((64, 32))
    s = spec("mxfp8", shape=(64, 32))
    ref = path_weight(Gemm.REFERENCE, w, s, None, mode, Backend.REFERENCE)
    quantized = mode is Backward.QUANTIZED
    want = [f"col:{F32}"] * quantized + [f"deq:{F32}", f"lp:{F32}"]
    assert sorted(ref.held) == want
    tc = path_weight(Gemm.TENSOR_CORE, w, s, None, mode, Backend.REFERENCE)
    assert tc.held == {} and (tc.col() is not None) == quantized


def test_a_partners_in_place_write_rebuilds_the_shared_global_scale():
    base = "model.layers.0.mlp"
    kw = {"fuse_group": f"{base}.gate_up", "shape": (32, 32)}
    gate_w, up_w = _w((32, 32), 1), _w((32, 32), 2)
    gate = QLinear(32, 32, False, spec("nvfp4", f"{base}.gate_proj.weight", **kw), "dequantized")
    gate.weight = gate_w
    gate.set_fuse_partner(up_w)
    before = gate.qweight(Gemm.REFERENCE)
    with torch.no_grad():
        up_w.mul_(8.0)  # now the larger of the two: the shared amax is up's
    after = gate.qweight(Gemm.REFERENCE)
    assert after is not before
    amax = up_w.detach().abs().max()
    want = decode_global_scale(quantize(gate_w.detach(), "nvfp4", global_amax=amax))
    assert_bytes_equal(after.s_dec, want, "shared scale")


def test_a_3d_input_with_a_bias_is_the_exact_product_plus_the_bias():
    """Small integers are E4M3 codes times a power-of-two block scale (module docstring of
    mxrl.formats.mxfp8): every MXFP8 copy is exact and so are the fp32 sums, so y is the float64
    product plus the bias, in x's leading shape."""
    lin = nn.Linear(32, 16, bias=True)
    with torch.no_grad():
        lin.weight.copy_((torch.arange(16 * 32).reshape(16, 32) % 7 - 3).float())
        lin.bias.copy_(torch.arange(16).float() / 4)
    q = QLinear.from_linear(lin, spec("mxfp8", shape=(16, 32)), "high_precision")
    assert q.weight is lin.weight and q.bias is lin.bias
    assert (q.in_features, q.out_features) == (32, 16)
    x = (torch.arange(2 * 3 * 32).reshape(2, 3, 32) % 5 - 2).float()
    want = x.double() @ lin.weight.detach().double().t() + lin.bias.detach().double()
    assert_bytes_equal(q(x).detach(), want.float(), "y")
    no_bias = QLinear.from_linear(
        nn.Linear(32, 16, bias=False), spec("mxfp8", shape=(16, 32)), "dequantized"
    )
    assert no_bias.bias is None and no_bias(x).shape == (2, 3, 16)


def test_a_qlinear_takes_its_modes_by_name_and_says_them():
    q = QLinear(32, 16, True, spec("mxfp8", shape=(16, 32)), "quantized", backend="reference")
    assert q.backward_mode is Backward.QUANTIZED and q.backend is Backend.REFERENCE
    assert q.gemm_choice is None and q._partner == []
    assert repr(q) == (
        "QLinear(in_features=32, out_features=16, bias=True, format=mxfp8, backward=quantized, "
        "backend=reference)"
    )
    with pytest.raises(ValueError, match="quantized"):
        QLinear(32, 16, True, spec("nvfp4", shape=(16, 32)), "quantized")


def _int_experts(e=2, h=32, i=32):
    experts = GroupedExperts(e, h, i)
    with torch.no_grad():
        experts.gate_up_proj.copy_(
            (torch.arange(e * 2 * i * h).reshape(e, 2 * i, h) % 7 - 3).float()
        )
        experts.down_proj.copy_((torch.arange(e * h * i).reshape(e, h, i) % 5 - 2).float())
    return experts


def test_experts_run_a_bf16_projection_plain_and_a_quantized_one_exactly():
    """gate_up in bf16 (not quantized, no mode check: the quantized backward is allowed beside
    it), down in MXFP8: on small integers both are the float64 products."""
    experts = _int_experts()
    set_gemm(experts, Gemm.REFERENCE)
    gu, down = _expert_specs("mxfp8", e=2, h=32, i=32)
    gu_bf16 = dataclasses.replace(gu, format="bf16")
    q = QExperts.from_experts(experts, gu_bf16, down, "quantized")
    assert q.gemm_choice is Gemm.REFERENCE and q.backend is Backend.REFERENCE
    assert q.gate_up_proj is experts.gate_up_proj and q.down_proj is experts.down_proj
    assert (q.num_experts, q.hidden_size, q.intermediate_size) == (2, 32, 32)
    assert q._grouped_specs() == {"gate_up": None, "down": down}
    x = (torch.arange(3 * 32).reshape(3, 32) % 5 - 2).float()
    for e in range(2):
        gu_w, down_w = experts.gate_up_proj[e].detach(), experts.down_proj[e].detach()
        want_gu = (x.double() @ gu_w.double().t()).float()
        assert_bytes_equal(q._gate_up(e, x).detach(), want_gu, f"gate_up {e}")
        want_down = (x.double() @ down_w.double().t()).float()
        assert_bytes_equal(q._down(e, x).detach(), want_down, f"down {e}")
    assert repr(q) == (
        "QExperts(num_experts=2, hidden_size=32, intermediate_size=32, gate_up=bf16, "
        "down=mxfp8, backward=quantized)"
    )
    with pytest.raises(ValueError, match="quantized"):
        QExperts.from_experts(experts, *_expert_specs("nvfp4", e=2, h=32, i=32), "quantized")
    with pytest.raises(TypeError, match="from_experts"):
        QExperts(2, 32, 32)


def test_experts_build_no_block_fp8_column_copy_for_the_grouped_gemms(scaled_mm):
    experts = GroupedExperts(2, 128, 128)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    specs = _expert_specs("fp8_block", e=2, h=128, i=128)
    q = QExperts.from_experts(experts, *specs, "quantized")
    for which in ("gate_up", "down"):
        tw = q.qweight(which, Gemm.TENSOR_CORE)
        assert tw.col() is None and tw.held == {}
        assert q.qweight(which, Gemm.TENSOR_CORE) is tw
    param = q.qweight("down", Gemm.REFERENCE).q
    assert_bytes_equal(
        param.qdata,
        quantize(experts.down_proj.detach(), "fp8_block", block=(128, 128)).qdata,
        "down codes",
    )


def test_the_grouped_gemms_run_a_bf16_projection_plain_and_a_quantized_one_exactly(monkeypatch):
    """The tensor-core path's grouped projections (off CUDA: the product of bf16 operands in
    fp32, a bf16 output), on small integers, exact in bf16 and in MXFP8: each sorted row times
    its expert's weight, the float64 product."""
    experts = _int_experts()
    gu, down = _expert_specs("mxfp8", e=2, h=32, i=32)
    q = QExperts.from_experts(experts, dataclasses.replace(gu, format="bf16"), down, "dequantized")
    layout = ExpertLayout.build(torch.tensor([[1], [0], [1], [1]]), 2)  # rows 0 | 1, 2, 3
    x = (torch.arange(4 * 32).reshape(4, 32) % 5 - 2).float()
    seen = []
    real = grouped_path.GroupedLinear.apply

    class Recorder:  # the grouped GEMM's arguments, then the real GEMM
        @staticmethod
        def apply(*args):
            seen.append(args[3:])
            return real(*args)

    monkeypatch.setattr(grouped_path, "GroupedLinear", Recorder)
    for which, param in (("gate_up", experts.gate_up_proj), ("down", experts.down_proj)):
        w = param.detach().double()
        want = torch.cat([x[:1].double() @ w[0].t(), x[1:].double() @ w[1].t()])
        y = q._grouped_proj(which, x, layout)
        assert_bytes_equal(y.detach(), want.to(torch.bfloat16), which)
    # gate_up in bf16 went to GroupedExperts' own GEMM; down read the tensor-core path's cached
    # weight (nothing derived held) with the layer's spec, mode and backend
    assert len(seen) == 1
    tw, s, mode, backend, tokens = seen[0]
    assert tokens is False  # the down projection reads the rows it is given
    assert tw is q.qweight("down", Gemm.TENSOR_CORE) and tw.held == {}
    assert s is down and mode is Backward.DEQUANTIZED and backend is q.backend


def test_the_loop_reads_the_reference_paths_cached_weight_with_the_layers_backend(monkeypatch):
    """One build per projection and path (a cache keyed by the path: the reference's holds fp32
    operands, the tensor core's none), shared by every expert's GEMM; each GEMM is given the
    layer's spec, mode and backend."""
    experts = _int_experts()
    specs = _expert_specs("mxfp8", e=2, h=32, i=32)
    q = QExperts.from_experts(experts, *specs, "dequantized")
    builds, gemms = [], []
    real_build, real_apply = qlinear.path_weight, reference_path.QMatmul.apply

    def build(gemm, *args, **kwargs):
        builds.append(gemm)
        return real_build(gemm, *args, **kwargs)

    class Recorder:  # the reference GEMM's arguments, then the real GEMM
        @staticmethod
        def apply(*args):
            gemms.append(args[3:])
            return real_apply(*args)

    monkeypatch.setattr(qlinear, "path_weight", build)
    monkeypatch.setattr(reference_path.ReferencePath, "function", Recorder)
    x = (torch.arange(3 * 32).reshape(3, 32) % 5 - 2).float()
    for e in range(2):
        q._down(e, x)
    ref = q.qweight("down", Gemm.REFERENCE)
    assert builds == [Gemm.REFERENCE]  # built once for both experts, then cached
    assert sorted(ref.held) == [f"deq:{F32}", f"lp:{F32}"]
    assert gemms == [(specs[1], Backward.DEQUANTIZED, q.backend)] * 2
    tc = q.qweight("down", Gemm.TENSOR_CORE)  # the other path: its own build, nothing held
    assert tc is not ref and tc.held == {} and builds == [Gemm.REFERENCE, Gemm.TENSOR_CORE]


def test_experts_without_a_gemm_choice_take_the_devices():
    experts = _int_experts()
    del experts.path  # an experts module from before the paths existed
    q = QExperts.from_experts(experts, *_expert_specs("mxfp8", e=2, h=32, i=32), "dequantized")
    assert q.gemm_choice is None


def test_a_qlinear_resolves_its_gemm_for_the_inputs_device(monkeypatch):
    """Without a choice the GEMM path is the input's device's default (tensor cores on CUDA,
    the reference on the CPU), not the process's default device's: a stand-in records what
    it is asked."""
    asked = []
    real = qlinear.resolved_gemm

    def stand_in(choice, device):
        asked.append((choice, device))
        return real(choice, device)

    monkeypatch.setattr(qlinear, "resolved_gemm", stand_in)
    q = QLinear(32, 16, False, spec("mxfp8", shape=(16, 32)), "dequantized")
    x = torch.ones(2, 32)
    q(x)
    set_gemm(q, Gemm.TENSOR_CORE)
    q(x)
    assert asked == [(None, x.device), (Gemm.TENSOR_CORE, x.device)]


def test_a_qlinear_is_built_on_the_device_and_dtype_asked_with_or_without_a_bias():
    s = spec("mxfp8", shape=(16, 32))
    meta = QLinear(32, 16, True, s, "dequantized", device="meta", dtype=torch.bfloat16)
    assert meta.weight.device.type == "meta" and meta.bias.device.type == "meta"
    assert meta.weight.dtype == torch.bfloat16 and meta.bias.dtype == torch.bfloat16
    assert QLinear(32, 16, False, s, "dequantized").bias is None


def test_from_linear_takes_the_linears_parameters_and_draws_no_random_numbers():
    """The swap reuses the Parameters (built on the meta device, nothing initialised): the
    global generator is where it was, so a seeded run draws the same numbers after a swap."""
    lin = nn.Linear(32, 16, bias=False)
    torch.manual_seed(7)
    q = QLinear.from_linear(lin, spec("mxfp8", shape=(16, 32)), "dequantized", Backend.TRITON)
    after = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(4))
    assert q.weight is lin.weight and q.bias is None and q.backend is Backend.TRITON


def test_path_weight_builds_on_the_layers_backend(monkeypatch):
    """The QWeight keeps the backend its bf16 operands and column copy are written on; the
    quantizer is a stand-in that records it and runs the reference (TRITON needs CUDA)."""
    seen = []
    real = weight.kernel_quantize

    def stand_in(t, fmt, *, backend=None, **kw):
        seen.append(backend)
        return real(t, fmt, backend=Backend.REFERENCE, **kw)

    monkeypatch.setattr(weight, "kernel_quantize", stand_in)
    w, s = _w((64, 32)), spec("mxfp8", shape=(64, 32))
    tw = path_weight(Gemm.TENSOR_CORE, w, s, None, Backward.QUANTIZED, Backend.TRITON)
    assert tw.backend is Backend.TRITON and tw.col() is not None
    assert seen == [Backend.TRITON, Backend.TRITON]  # the row-wise copy, then the column copy
