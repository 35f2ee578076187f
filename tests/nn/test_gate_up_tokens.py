"""The row-wise quantized gate/up projection takes x's tokens (`GroupedLinear`'s `tokens`,
`ExpertLayout.gate_up_tokens`): each token quantized once and its operand rows gathered, x's
gradient each token's k rows summed. Against the same module with the tokens gathered first
(`ROW_QUANTIZED` emptied: x's k fp32 copies gathered, each quantized), byte for byte over
optimizer steps: outputs, input and weight gradients, masters; and what the forward writes and
keeps: no gathered fp32 [R, H] copy of x, the tokens' copy saved for the backward, not the rows'.
On the CPU's grouped GEMMs (the reference kernels), and on CUDA (the Triton kernels)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mxrl.kernels import Gemm
from mxrl.nn import QExperts, set_gemm
from mxrl.nn.paths import grouped
from tests.nn.test_backends import under_interpreter
from tests.nn.test_hold_bf16 import QUANTIZED, _qmodule, _steps
from tests.nn.test_qmatmul import _expert_specs, _route
from tests.numerics import assert_bytes_equal

K = 2  # _route's experts per token


@pytest.mark.parametrize(("fmt", "backward"), QUANTIZED)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tokens_give_the_gathered_rows_bytes(fmt, backward, device, monkeypatch):
    make = _qmodule(fmt, backward)
    tokens = _steps(False, steps=2, device=device, make=make)
    monkeypatch.setattr(grouped, "ROW_QUANTIZED", ())
    rows = _steps(False, steps=2, device=device, make=make)
    assert len(tokens) == len(rows) == 2 * (2 * 2 + 4)
    for i, (a, b) in enumerate(zip(tokens, rows, strict=True)):
        assert_bytes_equal(a, b, f"{fmt} {backward} tensor {i}")


class Gathers(TorchDispatchMode):
    """The (shape, dtype) of every index_select's result (a gather of rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index_select.default:
            self.out.append((tuple(out.shape), out.dtype))
        return out


def _kept_bytes(y: torch.Tensor) -> int:
    """The bytes the GroupedLinear nodes of y's graph keep of their input: their saved tensors
    but the master weight (the last), and the QTensors of `ctx.xq` and `ctx.x_col`."""
    total, seen, todo = 0, set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "GroupedLinearBackward":
            total += sum(t.numel() * t.element_size() for t in node.saved_tensors[:-1])
            for name in ("xq", "x_col"):  # a DEQ wgrad's codes, MXFP8's column-wise copy
                q = getattr(node, name, None)
                if q is not None:
                    total += sum(t.numel() * t.element_size() for t in q.tensors().values())
        todo += [f for f, _ in node.next_functions]
    return total


def _forward(fmt: str, backward: str):
    """(the rows gathered, the bytes kept of x) of one micro-batch's forward."""
    q = _qmodule(fmt, backward)(False)
    x, ids, w = _route()
    x.requires_grad_(True)
    with torch.no_grad():
        q(x, ids, w)  # quantizes and caches the weights
    with Gathers() as seen:
        y = q(x, ids, w)
    return seen.out, _kept_bytes(y), x


@pytest.mark.parametrize(("fmt", "backward"), QUANTIZED)
def test_no_gathered_fp32_copy_and_the_tokens_copy_kept(fmt, backward, monkeypatch):
    gathered, kept, x = _forward(fmt, backward)
    rows_shape = (x.shape[0] * K, x.shape[1])
    assert (rows_shape, torch.float32) not in gathered, "x's k fp32 copies were gathered"
    monkeypatch.setattr(grouped, "ROW_QUANTIZED", ())
    gathered_rows, kept_rows, _ = _forward(fmt, backward)
    assert (rows_shape, torch.float32) in gathered_rows  # the check sees the old gather
    assert kept_rows > 0
    if backward == "quantized":  # both keep MXFP8's padded column-wise codes of x only
        assert kept == kept_rows
    else:  # HP: bf16 x, DEQ: its codes, of T tokens instead of R = T k rows (and down's R rows)
        assert kept < kept_rows, (kept, kept_rows)


def _fp8_block_run(backward: str):
    """Block-FP8 experts (H = I = 128, the kernels' blocks) on the grouped path, under the
    interpreter: output, input and weight gradients of one micro-batch."""
    from mxrl.nn import GroupedExperts

    torch.manual_seed(3)
    experts = GroupedExperts(4, 128, 128)
    experts.reset_parameters(std=0.05)
    q = QExperts.from_experts(experts, *_expert_specs("fp8_block", e=4, h=128, i=128), backward)
    set_gemm(q, Gemm.TENSOR_CORE)
    g = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(21)])
    x = torch.randn(21, 128, generator=g).requires_grad_(True)
    w = torch.rand(21, K, generator=g)
    y = q(x, ids, w)
    y.backward(torch.randn(y.shape, generator=g).to(y.dtype))
    return [y.detach(), x.grad, q.gate_up_proj.grad, q.down_proj.grad]


@under_interpreter
@pytest.mark.parametrize("backward", ["high_precision", "dequantized", "quantized"])
def test_block_fp8_tokens_give_the_gathered_rows_bytes(backward, monkeypatch):
    """Block FP8's 1 x 128 activation blocks are row-wise too: its codes and scales gathered
    per row, its quantized backward's padded copy read from the tokens."""
    tokens = _fp8_block_run(backward)
    monkeypatch.setattr(grouped, "ROW_QUANTIZED", ())
    rows = _fp8_block_run(backward)
    for name, a, b in zip(("y", "dx", "d gate_up", "d down"), tokens, rows, strict=True):
        assert_bytes_equal(a, b, f"fp8_block {backward} {name}")


@pytest.mark.parametrize(("fmt", "backward"), QUANTIZED)
def test_the_gate_up_gemm_reads_the_formats_own_operand_rows(fmt, backward, monkeypatch):
    """Against `mxrl.formats` directly, not another path of the same code: the gate/up GEMM's
    activation operand is Qa(x)'s bf16 values (no NVFP4 global scale) of each sorted row's
    token, and NVFP4's output is the GEMM's bf16 rows times fl(s_x s_w) rounded to bf16."""
    from mxrl.formats import decode_global_scale, dequantize, quantize
    from mxrl.nn.paths.permute import ExpertLayout
    from mxrl.recipe.quantize import activation_quantizer_kwargs

    q = _qmodule(fmt, backward)(False)
    x, ids, _ = _route()
    layout = ExpertLayout.build(ids, q.num_experts, gate_up_tokens=True)
    calls = []
    real = grouped.grouped_mm
    monkeypatch.setattr(grouped, "grouped_mm", lambda a, b, e: calls.append(a) or real(a, b, e))
    y = q._grouped_proj("gate_up", x, layout)
    spec = q.specs["gate_up"]
    xq = quantize(x[layout.token_of], fmt, **activation_quantizer_kwargs(spec))
    assert_bytes_equal(calls[0], dequantize(xq, global_scale=False).to(torch.bfloat16), "operand")
    if fmt == "nvfp4":
        tw = q.qweight("gate_up", Gemm.TENSOR_CORE)
        s_w = tw.s_dec[layout.row_expert].reshape(-1, 1)
        plain = real(
            calls[0], tw.operand(grouped.Form.LP, torch.bfloat16).transpose(-2, -1), layout.ends
        )
        want = (plain.float() * (decode_global_scale(xq) * s_w)).to(torch.bfloat16)
        assert_bytes_equal(y, want, "scaled output")


@pytest.mark.parametrize(("fmt", "backward"), QUANTIZED)
def test_the_projections_kernels_get_the_layers_backend(fmt, backward, monkeypatch):
    """Every quantizer, QDQ, dequantize and scale call of a grouped projection and its backward
    is given the layer's backend (triton here; the stand-ins record it and run the reference,
    the same bytes): a call left to the device default would run the reference on a GPU."""
    from mxrl.kernels import Backend

    seen: list[tuple[str, object]] = []

    def spy(name, real):
        def call(*args, **kwargs):
            if name == "quantize_activation":  # (x, spec, backend)
                given, args = args[2], (*args[:2], Backend.REFERENCE)
            else:
                given, kwargs = kwargs.get("backend", "none given"), kwargs | {"backend": None}
            seen.append((name, given))
            return real(*args, **kwargs)

        return call

    for name in ("quantize_mxfp8_padded", "qdq_mxfp8", "kernel_dequantize", "scale_bf16",
                 "quantize_activation"):  # fmt: skip
        monkeypatch.setattr(grouped, name, spy(name, getattr(grouped, name)))
    q = _qmodule(fmt, backward)(False)
    q.backend = Backend.TRITON
    x, ids, w = _route()
    q(x.requires_grad_(True), ids, w).sum().backward()
    assert seen and all(b is Backend.TRITON for _, b in seen), seen


@pytest.mark.parametrize(("fmt", "backward"), [("mxfp8", "quantized"), ("nvfp4", "dequantized")])
def test_only_the_gradients_asked_for_are_made(fmt, backward):
    """Frozen weights: x's gradient only, the tokens' sum; x without grad: the weights' only."""
    q = _qmodule(fmt, backward)(False)
    x, ids, w = _route()
    for p in q.parameters():
        p.requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    q(xg, ids, w).sum().backward()
    assert xg.grad is not None and xg.grad.shape == x.shape
    assert q.gate_up_proj.grad is None and q.down_proj.grad is None
    for p in q.parameters():
        p.requires_grad_(True)
    q(x, ids, w).sum().backward()
    assert q.gate_up_proj.grad is not None and q.down_proj.grad is not None


def test_the_padded_layout_is_built_once_a_layer(monkeypatch):
    """MXFP8's quantized backward pads both projections' rows per expert the same way: one
    `PaddedLayout` a layer's forward (`ExpertLayout.padded`), shared by gate/up and down."""
    from mxrl.nn.paths.permute import PaddedLayout

    built = []
    real = PaddedLayout.build.__func__
    monkeypatch.setattr(
        PaddedLayout, "build", classmethod(lambda cls, *a: built.append(a[1:]) or real(cls, *a))
    )
    q = _qmodule("mxfp8", "quantized")(False)
    x, ids, w = _route()
    q(x.requires_grad_(True), ids, w).sum().backward()
    assert built == [(32,)], built  # one build, MXFP8 blocks
    assert q.gate_up_proj.grad is not None and q.down_proj.grad is not None
