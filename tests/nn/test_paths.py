"""The GEMM paths as strategy objects (mxrl/nn/paths/__init__.py, docs/design.md §4.5): one path
per `Gemm`, and a QLinear's GEMM (a QExperts' routed experts) run through the path of its choice
gives, byte for byte, what that path's autograd Function(s) give called directly (forward and the
gradients); the engine's
`RolloutPath`: which weights stay packed, when experts may be captured in a CUDA graph, and a
projection's tiles."""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import quantize
from mxrl.kernels import Backend, Gemm
from mxrl.nn import GroupedExperts, QExperts, QLinear, invariant
from mxrl.nn.moe import moe_loop
from mxrl.nn.paths import PATHS, GemmPath, ReferencePath, TensorCorePath, path_for, set_gemm
from mxrl.nn.paths.grouped import GroupedLinear, grouped_experts_forward
from mxrl.nn.paths.reference import QMatmul, emulated_matmul
from mxrl.nn.paths.rollout import (
    Grouping,
    RolloutExperts,
    RolloutLinear,
    RolloutPath,
    uses_fp8_block_gemm,
    uses_low_bit_gemm,
)
from mxrl.nn.paths.tensor_core import TensorCoreQMatmul
from mxrl.recipe import Backward
from tests.nn.test_qmatmul import _expert_specs, spec
from tests.numerics import assert_bytes_equal


def test_every_gemm_has_its_path():
    assert set(PATHS) == set(Gemm)
    for gemm in Gemm:
        path: GemmPath = path_for(gemm)
        assert path.gemm is gemm and path.autograd
        assert path_for(gemm.value) is path  # a name resolves to the same object
    assert isinstance(path_for(Gemm.REFERENCE), ReferencePath)
    assert isinstance(path_for(Gemm.TENSOR_CORE), TensorCorePath)
    with pytest.raises(ValueError):
        path_for("cublas")


def test_set_gemm_gives_the_trainers_modules_a_path_and_leaves_the_engines():
    """A trainer module holds its path (None: the device's, per call); `gemm_choice` names it
    and is read-only; the engine's modules keep their `RolloutPath`."""
    q = QLinear(64, 32, False, spec("mxfp8", shape=(32, 64)), "dequantized")
    experts = GroupedExperts(2, 32, 32)
    model = torch.nn.ModuleList([q, experts])
    assert q.path is None and experts.path is None and q.gemm_choice is None
    assert set_gemm(model, "tensor_core") == 2
    assert q.path is experts.path is path_for(Gemm.TENSOR_CORE)
    assert q.gemm_choice is experts.gemm_choice is Gemm.TENSOR_CORE
    with pytest.raises(AttributeError):
        q.gemm_choice = Gemm.REFERENCE
    assert set_gemm(model, None) == 2 and q.path is None and experts.gemm_choice is None
    linear = RolloutLinear(spec("mxfp8", shape=(32, 64)), torch.float32, Backend.REFERENCE, 8)
    rollout = linear.path
    assert set_gemm(linear, "reference") == 0 and linear.path is rollout


def _direct(op, q, gemm, x, s, mode):
    """op.apply on the layer's cached weight of `gemm`: y, dx, dw for a gradient of ones."""
    x = x.detach().requires_grad_()
    q.weight.grad = None
    y = op.apply(x, q.weight, q.qweight(gemm), s, Backward(mode), Backend.REFERENCE)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad, q.weight.grad.clone()


@pytest.mark.parametrize("fmt,mode", [("mxfp8", "high_precision"), ("nvfp4", "dequantized")])
def test_a_qlinear_runs_the_function_of_its_path(fmt, mode):
    """On these formats and modes the two Functions give different bytes on the CPU (bf16
    operands against fp32), so the layer's bytes tell which one ran."""
    s = spec(fmt, shape=(32, 64))
    torch.manual_seed(0)
    q = QLinear(64, 32, False, s, mode)
    x = torch.randn(5, 64)
    ops = {Gemm.REFERENCE: QMatmul, Gemm.TENSOR_CORE: TensorCoreQMatmul}
    direct = {gemm: _direct(op, q, gemm, x, s, mode) for gemm, op in ops.items()}
    assert not all(map(torch.equal, *direct.values()))
    for gemm in ops:
        set_gemm(q, gemm)
        xg = x.clone().requires_grad_()
        q.weight.grad = None
        y = q(xg)
        y.backward(torch.ones_like(y))
        got = (y.detach(), xg.grad, q.weight.grad)
        for name, a, b in zip(("y", "dx", "dw"), got, direct[gemm], strict=True):
            assert_bytes_equal(a, b, f"{gemm} {name}")


class _Direct:
    """QExperts' projections called straight on the autograd Functions: `QMatmul` per expert
    for the reference's loop, `GroupedLinear` per projection for the tensor core's grouped
    GEMMs, on the layer's cached weights of that path."""

    def __init__(self, q, gemm):
        self.q, self.gemm, self.num_experts, self.rowwise = q, gemm, q.num_experts, q.rowwise

    def _args(self, which):
        q = self.q
        param = q.gate_up_proj if which == "gate_up" else q.down_proj
        mode, backend = q.backward_mode, Backend.REFERENCE
        return param, q.qweight(which, self.gemm), q.specs[which], mode, backend

    def _grouped_specs(self):
        return self.q._grouped_specs()

    def _grouped_proj(self, which, x_sorted, layout):
        param, w, s, mode, backend = self._args(which)
        tokens = which == "gate_up" and layout.gate_up_tokens  # x's tokens: gathered there
        return GroupedLinear.apply(x_sorted, param, layout, w, s, mode, backend, tokens)

    def _proj(self, which, e, x):
        param, w, s, mode, backend = self._args(which)
        return QMatmul.apply(x, param[e], w.for_expert(e), s, mode, backend)

    def expert(self, e, x):
        gate, up = self._proj("gate_up", e, x).chunk(2, dim=-1)
        return self._proj("down", e, invariant.silu_mul(gate, up))

    def __call__(self, x, ids, weights):
        if self.gemm is Gemm.TENSOR_CORE:
            return grouped_experts_forward(self, x, ids, weights)
        return moe_loop(x, ids, weights, self.num_experts, self.expert)


def _experts_run(q, run, x, ids, weights):
    """y, dx, d gate_up, d down of `run` for a gradient of ones."""
    x = x.detach().requires_grad_()
    q.gate_up_proj.grad = q.down_proj.grad = None
    y = run(x, ids, weights)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad, q.gate_up_proj.grad.clone(), q.down_proj.grad.clone()


@pytest.mark.parametrize("fmt,mode", [("mxfp8", "high_precision"), ("nvfp4", "dequantized")])
def test_a_qexperts_runs_the_functions_of_its_path(fmt, mode):
    """Routed experts whose shapes the grouped GEMMs take: on the CPU the reference's loop (fp32
    operands) and the tensor core's grouped GEMMs (bf16 operands) give different bytes, so the
    layer's bytes tell which path ran."""
    torch.manual_seed(0)
    experts = GroupedExperts(2, 32, 32)
    experts.reset_parameters(std=0.1)
    q = QExperts.from_experts(experts, *_expert_specs(fmt, e=2, h=32, i=32), mode)
    x = torch.randn(5, 32)
    ids = torch.tensor([[0, 1], [1, 0], [1, 0], [0, 1], [1, 0]])
    weights = torch.rand(5, 2)
    direct = {g: _experts_run(q, _Direct(q, g), x, ids, weights) for g in Gemm}
    assert not all(map(torch.equal, *direct.values()))
    for gemm in Gemm:
        set_gemm(q, gemm)
        got = _experts_run(q, q, x, ids, weights)
        for name, a, b in zip(("y", "dx", "d gate_up", "d down"), got, direct[gemm], strict=True):
            assert_bytes_equal(a, b, f"{gemm} {name}")


def test_the_rollout_path_captures_experts_only_when_they_run_grouped():
    """A CUDA graph may hold the engine's routed experts only where nothing is read back to the
    host (one grouped launch per projection; the loop reads the per-expert counts); a
    projection's tiles always."""
    gu, down = _expert_specs("mxfp8", e=2, h=32, i=32)
    experts = RolloutExperts(GroupedExperts(2, 32, 32), {"gate_up": gu, "down": down},
                             torch.float32, 8, Backend.REFERENCE)  # fmt: skip
    assert experts.path.tile == experts.tile == 8 and experts.backend is Backend.REFERENCE
    assert experts.grouping is None
    assert not experts.path.graph_safe(experts)
    for grouping in Grouping:
        experts.grouping = grouping
        assert experts.path.graph_safe(experts), grouping
        experts.grouping = None
    assert not experts.path.graph_safe(experts)
    linear = RolloutLinear(spec("mxfp8", shape=(32, 64)), torch.float32, Backend.REFERENCE, 8)
    assert linear.path.graph_safe(linear)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8_block", "bf16"])
@pytest.mark.parametrize("backend", list(Backend))
def test_the_rollout_path_decides_which_weights_stay_packed(fmt, backend):
    s = spec(fmt, shape=(256, 256))
    want = uses_low_bit_gemm(s, backend) or uses_fp8_block_gemm(s, backend)
    assert want == (backend is Backend.TRITON and fmt != "bf16")
    assert RolloutPath(8, backend).packed(s) == want
    assert RolloutLinear(s, torch.float32, backend, 8).packed == want


@pytest.mark.parametrize("tile", [0, 4])
def test_a_rollout_linear_runs_its_paths_tiles(tile):
    """A received MXFP8 weight on the reference backend: the emulated GEMM on tiles of `tile`
    rows (the last one zero-padded), or on all rows at once with tile 0."""
    s = spec("mxfp8", shape=(32, 64))
    torch.manual_seed(0)
    w = quantize(torch.randn(32, 64), "mxfp8")
    linear = RolloutLinear(s, torch.float32, Backend.REFERENCE, tile)
    linear.w = linear.materialize(w)["w"]
    x = torch.randn(6, 64)
    y = linear(x)
    assert not linear.packed
    assert_bytes_equal(y, linear.path.linear(x, linear.w, None, s, None, None), "path")
    padded = torch.cat([x, x.new_zeros((-6) % tile if tile else 0, 64)])
    tiles = padded.split(tile) if tile else [x]
    want = torch.cat([emulated_matmul(t, linear.w, s)[0] for t in tiles])[:6]
    assert_bytes_equal(y, want, "tiles")


@pytest.mark.parametrize("path", [ReferencePath(), TensorCorePath()], ids=repr)
def test_a_paths_linear_hands_its_function_every_argument_as_given(path, monkeypatch):
    # the backend especially: on the CPU the reference and Triton give the same bytes, so only
    # the arguments themselves show a path dropping one (the GPU runs the one it is given)
    import mxrl.nn.paths.grouped as grouped_mod
    import mxrl.nn.paths.reference as reference_mod

    calls = []
    target = reference_mod.QMatmul if path.gemm is Gemm.REFERENCE else grouped_mod.TensorCoreQMatmul
    monkeypatch.setattr(target, "apply", lambda *args: calls.append(args) or "y")
    x, master, w, s = object(), object(), object(), object()
    assert path.linear(x, w, master, s, Backward.QUANTIZED, Backend.TRITON) == "y"
    assert calls == [(x, master, w, s, Backward.QUANTIZED, Backend.TRITON)]
    assert repr(path) == f"{type(path).__name__}()"
