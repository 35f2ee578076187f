"""The routed experts' held bf16 weights (`GroupedExperts.hold_bf16`, `rl.hold_bf16_weights`): the
grouped bf16 GEMMs read one copy of each fp32 master per optimizer step instead of a cast per
forward and per dgrad, with the same bytes. On the CPU, where torch._grouped_mm runs in bf16
(the tensor-core path's logic); the GPU tier repeats the bytes check on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mxrl.arch import builtin_config
from mxrl.kernels import Gemm
from mxrl.models import build_model
from mxrl.nn import GroupedExperts, QExperts, apply_plan, set_gemm, weights_changed
from mxrl.recipe import resolve
from tests.nn.test_qmatmul import _expert_specs, _experts, _route
from tests.numerics import assert_bytes_equal

BF16 = torch.bfloat16


class MasterCasts(TorchDispatchMode):
    """Counts the fp32 -> bf16 copies of tensors shaped like one of `shapes` (the masters)."""

    def __init__(self, shapes) -> None:
        super().__init__()
        self.shapes = {tuple(s) for s in shapes}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args else None
        if (
            func is torch.ops.aten._to_copy.default
            and isinstance(src, torch.Tensor)
            and src.dtype == torch.float32
            and kwargs.get("dtype") == BF16
            and tuple(src.shape) in self.shapes
        ):
            self.count += 1
        return func(*args, **kwargs)


def _module(hold: bool, seed: int = 0, device: str = "cpu") -> GroupedExperts:
    experts = _experts(seed).to(device)
    set_gemm(experts, Gemm.TENSOR_CORE)
    experts.set_hold_bf16(hold)
    return experts


def _micro_batch(experts, seed: int):
    device = experts.gate_up_proj.device
    x, ids, w = (t.to(device) for t in _route(seed=seed))
    x.requires_grad_(True)
    y = experts(x, ids, w)
    y.square().sum().backward()
    return y.detach(), x.grad


def _steps(hold: bool, steps: int = 3, micro: int = 2, device: str = "cpu", make=None):
    """`steps` optimizer steps of `micro` micro-batches each; every output, input gradient and
    master after each step. make(hold, device): the experts module (`_module`'s bf16 ones)."""
    experts = (make or _module)(hold, device=device)
    opt = torch.optim.SGD(experts.parameters(), lr=0.5)
    seen = []
    for step in range(steps):
        for m in range(micro):
            seen += _micro_batch(experts, seed=10 * step + m)
        seen += [experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()]
        opt.step()  # the global post-step hook moves the weights epoch
        opt.zero_grad()
        seen += [experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()]
    return seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_held_copies_give_the_cast_bytes_over_optimizer_steps(device):
    """Outputs, input and weight gradients, and the masters after each of 3 optimizer steps of 2
    micro-batches: the same bytes held as cast (a copy held past an optimizer step would read
    the old weights and differ from the second step on); on CUDA, torch._grouped_mm's CUTLASS
    kernels."""
    cast, held = _steps(False, device=device), _steps(True, device=device)
    assert len(cast) == len(held) == 3 * (2 * 2 + 4)
    for i, (a, b) in enumerate(zip(held, cast, strict=True)):
        assert_bytes_equal(a, b, f"tensor {i}")


def _casts_per_step(experts, steps: int = 2, micro: int = 3) -> list[int]:
    """The fp32 -> bf16 copies of master shape in each of `steps` optimizer steps of `micro`
    micro-batches."""
    opt = torch.optim.SGD(experts.parameters(), lr=0.1)
    shapes = [experts.gate_up_proj.shape, experts.down_proj.shape]
    counts = []
    for step in range(steps):
        with MasterCasts(shapes) as casts:
            for m in range(micro):
                _micro_batch(experts, seed=m + step)
        counts.append(casts.count)
        opt.step()
        opt.zero_grad()
    return counts


def test_a_master_is_cast_once_per_optimizer_step_when_held():
    """Cast per GEMM: each master twice a micro-batch (its forward and its dgrad); held: once per
    optimizer step (the first forward), none in the later micro-batches or their backwards."""
    for hold, per_step in ((False, 2 * 2 * 3), (True, 2)):
        assert _casts_per_step(_module(hold)) == [per_step, per_step], hold


def test_a_held_copy_is_the_master_cast_and_follows_in_place_writes():
    experts = _module(True)
    held = experts.bf16_weight("gate_up")
    assert_bytes_equal(held, experts.gate_up_proj.detach().to(BF16), "held copy")
    assert experts.bf16_weight("gate_up") is held, "kept while the master is unchanged"
    with torch.no_grad():  # a load writes in place: its version counter moves
        experts.gate_up_proj.mul_(2.0)
    again = experts.bf16_weight("gate_up")
    assert again is not held
    assert_bytes_equal(again, experts.gate_up_proj.detach().to(BF16), "after a write")
    weights_changed()  # FSDP2's re-gather or a DCP load: the epoch, not the version
    assert experts.bf16_weight("gate_up") is not again
    assert experts.bf16_weight("down") is not None


def test_a_write_between_forward_and_backward_is_refused_as_when_cast():
    """The held copy must not let a backward read weights the forward did not use."""
    for hold in (False, True):
        experts = _module(hold)
        x, ids, w = _route()
        y = experts(x.requires_grad_(True), ids, w)
        with torch.no_grad():
            experts.down_proj.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_off_holds_nothing_and_turning_it_off_frees_the_copies():
    experts = _module(False)
    assert experts.bf16_weight("gate_up") is None
    _micro_batch(experts, seed=1)
    assert all(c._value is None for c in experts._bf16.values())
    experts.set_hold_bf16(True)
    _micro_batch(experts, seed=1)
    assert all(c._value is not None for c in experts._bf16.values())
    experts.set_hold_bf16(False)
    assert all(c._value is None for c in experts._bf16.values())


def test_training_options_set_every_experts_module_and_qexperts_bf16_projections():
    model = build_model(builtin_config("tiny-moe"), seed=0)
    apply_plan(model, resolve("bf16", {n: p.shape for n, p in model.named_parameters()}))
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts and not any(m.hold_bf16 for m in experts)
    model.set_training_options(compute_dtype=BF16, hold_bf16_weights=True)
    assert all(m.hold_bf16 for m in experts)
    model.set_training_options(compute_dtype=BF16)
    assert not any(m.hold_bf16 for m in experts)
    # a QExperts whose down projection is bf16 reads its held copy, with the cast's bytes
    gate_up, down = _expert_specs("mxfp8")
    down = down.__class__(**{**down.__dict__, "format": "bf16"})
    outs = []
    for hold in (False, True):
        q = QExperts.from_experts(_experts(), gate_up, down, "dequantized")
        set_gemm(q, Gemm.TENSOR_CORE)
        q.set_hold_bf16(hold)
        outs.append(_micro_batch(q, seed=3))
        assert (q._bf16["down"]._value is not None) is hold
        assert q._bf16["gate_up"]._value is None, "a quantized projection holds no bf16 copy"
    for a, b in zip(*outs, strict=True):
        assert_bytes_equal(a, b)
    # set before the plan is applied: the swapped-in QExperts keeps the choice
    held = _experts()
    held.set_hold_bf16(True)
    assert QExperts.from_experts(held, gate_up, down, "dequantized").hold_bf16 is True


# --- quantized experts: the one bf16 operand their weight keeps (`kept_forms`) ------------------

QUANTIZED = [
    ("mxfp8", "high_precision"),
    ("mxfp8", "dequantized"),
    ("mxfp8", "quantized"),
    ("nvfp4", "high_precision"),
    ("nvfp4", "dequantized"),
]


def _qmodule(fmt: str, backward: str):
    def make(hold: bool, seed: int = 0, device: str = "cpu") -> QExperts:
        q = QExperts.from_experts(_experts(seed).to(device), *_expert_specs(fmt), backward)
        set_gemm(q, Gemm.TENSOR_CORE)
        q.set_hold_bf16(hold)
        return q

    return make


@pytest.mark.parametrize(("fmt", "backward"), QUANTIZED)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_quantized_experts_kept_operand_gives_the_unkept_bytes(fmt, backward, device):
    """As the bf16 copies above: 3 optimizer steps of 2 micro-batches, every output, gradient
    and master the same bytes with the operand kept per step as made per GEMM."""
    make = _qmodule(fmt, backward)
    made, kept = _steps(False, device=device, make=make), _steps(True, device=device, make=make)
    for i, (a, b) in enumerate(zip(kept, made, strict=True)):
        assert_bytes_equal(a, b, f"{fmt} {backward} tensor {i}")


# bf16 operands of master shape made per weight in one optimizer step of m micro-batches:
# (made per GEMM, kept); each micro-batch's forward reads LP, its dgrad HP (the master cast),
# DEQ or COL; kept, the `kept_forms` one is made once a step (MXFP8's DEQ is its LP; the
# quantized backward keeps none)
MADE = {
    ("mxfp8", "high_precision"): (lambda m: 2 * m, lambda m: m + 1),
    ("mxfp8", "dequantized"): (lambda m: 2 * m, lambda m: 1),
    ("mxfp8", "quantized"): (lambda m: 2 * m, lambda m: 2 * m),  # keeps none
    ("nvfp4", "high_precision"): (lambda m: 2 * m, lambda m: m + 1),
    ("nvfp4", "dequantized"): (lambda m: 2 * m, lambda m: m + 1),
}


@pytest.mark.parametrize(("fmt", "backward"), QUANTIZED)
def test_a_kept_operand_is_made_once_per_optimizer_step(fmt, backward):
    make = _qmodule(fmt, backward)
    for hold, count in zip((False, True), MADE[(fmt, backward)], strict=True):
        assert _casts_per_step(make(hold)) == [2 * count(3)] * 2, hold


def test_turning_hold_off_frees_a_quantized_experts_kept_operand():
    q = _qmodule("mxfp8", "high_precision")(True)
    _micro_batch(q, seed=1)
    held = q._caches["gate_up"]._value.held
    assert list(held) == ["hp:torch.bfloat16"]
    assert_bytes_equal(held["hp:torch.bfloat16"], q.gate_up_proj.detach().to(BF16), "kept HP")
    q.set_hold_bf16(False)
    assert all(c._value is None for c in q._caches.values())
    _micro_batch(q, seed=1)
    assert q._caches["gate_up"]._value.held == {}
