"""QLinear and QExperts: drop-in replacements for nn.Linear and GroupedExperts, driven by a
plan's TensorSpec. They reuse the original Parameters (master weights stay high precision, the
optimizer keeps its state) and quantize the weight once per optimizer step: one `QWeight` per
weight, built by the GEMM path that runs (`path_weight`) and cached until the next optimizer
step (`WeightCache`)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from mxrl.formats.constants import Format
from mxrl.kernels import Backend
from mxrl.kernels.backend import Gemm
from mxrl.nn.experts import GroupedExperts
from mxrl.nn.gemm import no_autocast, resolved_gemm
from mxrl.nn.operands import Form
from mxrl.nn.paths import GemmPath, path_for
from mxrl.nn.paths.tensor_core import uses_scaled_mm
from mxrl.nn.weight import QWeight, WeightCache
from mxrl.recipe import Backward, TensorSpec


def _check_mode(spec: TensorSpec, backward: Backward) -> None:
    if backward is Backward.QUANTIZED and spec.format not in (Format.MXFP8, Format.FP8_BLOCK):
        raise ValueError(
            f"{spec.name}: backward 'quantized' runs backward GEMMs in MXFP8 or block FP8 and "
            f"needs mxfp8 or fp8_block weights, but the plan gives {spec.format}; use "
            "high_precision or dequantized"
        )


def path_weight(
    gemm: Gemm,
    weight: torch.Tensor,
    spec: TensorSpec,
    partner: torch.Tensor | None,
    mode: Backward,
    backend: Backend,
    *,
    grouped: bool = False,
) -> QWeight:
    """The QWeight of a master weight as the `gemm` path reads it, kept until the next
    optimizer step (`WeightCache`). Every path holds the QTensor; what else, by path:

    REFERENCE    its fp32 operands, derived when it is built: LP, DEQ and, for MXFP8's
                 quantized backward, COL (block FP8's dgrad reads the forward's square blocks,
                 DEQ: no second copy).
    TENSOR_CORE  nothing derived (8.25 / 4.5 / ~8 bits per weight instead of a bf16 copy's 16
                 beside the fp32 master and its gradient): each bf16 operand is written by
                 `mxrl.kernels.dequantize` (one read of the bytes, one bf16 write) when its GEMM
                 runs and freed after it. The quantized backward's dgrad weight (`col`): the
                 column-wise MXFP8 QTensor, or a dense (not `grouped`) block-FP8 weight's w^T
                 in the same square blocks where the FP8 GEMM reads it (`uses_scaled_mm`;
                 routed experts' grouped dgrad reads the forward's codes transposed in place);
                 made when the backward first asks for it, then held: after an optimizer step
                 the forward holds the row-wise copies only, and the column-wise ones appear
                 layer by layer as the backward frees the activations.
    """
    fp8_col = gemm is Gemm.TENSOR_CORE and not grouped and uses_scaled_mm(spec, weight.device)
    colwise = mode is Backward.QUANTIZED and (spec.format is Format.MXFP8 or fp8_col)
    w = QWeight.from_master(weight, spec, partner, colwise=colwise, backend=backend)
    if gemm is Gemm.TENSOR_CORE:
        return w
    return w.hold(Form.LP, Form.DEQ, *([Form.COL] if colwise else []), dtype=torch.float32)


def kept_forms(mode: Backward) -> tuple[Form, ...]:
    """The bf16 operand a routed expert's quantized weight keeps from its first GEMM to the
    next optimizer step under `hold_bf16` (`QWeight.keep_operands`; 2 bytes a weight, the bf16
    experts' held copy): the one that costs most to make again each micro-batch.
    high_precision: HP, the master cast for the dgrad (4 bytes read, 2 written, every
    backward); dequantized: DEQ (MXFP8's and block FP8's is their LP: the forward and the
    dgrad read one copy). The quantized backward keeps none: block FP8's reads codes only, and
    MXFP8's holds its column-wise copy already (keeping its LP too took its peak to 1.08x
    bf16's for no measured gain, docs/benchmarks.md)."""
    if mode is Backward.HIGH_PRECISION:
        return (Form.HP,)
    if mode is Backward.DEQUANTIZED:
        return (Form.DEQ,)
    return ()


class QLinear(nn.Linear):
    """y = Qa(x) (x) Qw(weight) + bias, for x [..., K], on the GEMM path it holds (`path`, set by
    `mxrl.nn.paths.set_gemm`; None: the input device's, `path_for`): `QMatmul` for the
    reference, `TensorCoreQMatmul` on tensor cores."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        spec: TensorSpec,
        backward: Backward | str,
        *,
        backend: Backend = Backend.REFERENCE,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.spec = spec
        self.backward_mode = Backward(backward)
        self.backend = Backend(backend)
        _check_mode(spec, self.backward_mode)
        self._cache = WeightCache()
        self._partner: list[nn.Parameter] = []  # fuse partner's weight; a list: not a submodule
        self.path: GemmPath | None = None  # None: by device (mxrl.kernels.Kernels.resolve)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        spec: TensorSpec,
        backward: Backward | str,
        backend: Backend = Backend.REFERENCE,
    ) -> QLinear:
        q = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            spec,
            backward,
            backend=backend,
            device="meta",
        )
        q.weight = linear.weight
        q.bias = linear.bias
        return q

    @property
    def gemm_choice(self) -> Gemm | None:
        """The held path's `Gemm`, None by device (read-only: `set_gemm` sets the path)."""
        return None if self.path is None else self.path.gemm

    def set_fuse_partner(self, weight: nn.Parameter) -> None:
        """Share one NVFP4 global scale with another weight (gate with up)."""
        self._partner = [weight]
        self._cache.clear()

    def qweight(self, gemm: Gemm) -> QWeight:
        """The quantized weight as the `gemm` path builds it, cached until the weight changes."""
        partner = self._partner[0] if self._partner else None
        tensors = (self.weight,) if partner is None else (self.weight, partner)
        args = (gemm, self.weight, self.spec, partner, self.backward_mode, self.backend)
        return self._cache.get(tensors, functools.partial(path_weight, *args), kind=gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        args = (self.spec, self.backward_mode, self.backend)
        with no_autocast(x.device):
            gemm = resolved_gemm(self.gemm_choice, x.device)
            path = self.path if self.path is not None else path_for(gemm)
            y = path.linear(x2, self.qweight(gemm), self.weight, *args)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, format={self.spec.format}, backward={self.backward_mode}, "
            f"backend={self.backend}"
        )


class QExperts(GroupedExperts):
    """GroupedExperts whose gate_up and down GEMMs are quantized per their specs (either may be
    bf16). Per-token activation scales make each token's bytes independent of its batch."""

    def __init__(self, *args, **kwargs) -> None:
        raise TypeError("build QExperts with QExperts.from_experts(experts, specs, backward)")

    @classmethod
    def from_experts(
        cls,
        experts: GroupedExperts,
        gate_up_spec: TensorSpec,
        down_spec: TensorSpec,
        backward: Backward | str,
        backend: Backend = Backend.REFERENCE,
    ) -> QExperts:
        q = cls.__new__(cls)
        nn.Module.__init__(q)
        q.num_experts = experts.num_experts
        q.hidden_size = experts.hidden_size
        q.intermediate_size = experts.intermediate_size
        q.gate_up_proj = experts.gate_up_proj
        q.down_proj = experts.down_proj
        q.backward_mode = Backward(backward)
        q.backend = Backend(backend)
        q.specs = {"gate_up": gate_up_spec, "down": down_spec}
        for spec in q.specs.values():
            if spec.format is not Format.BF16:
                _check_mode(spec, q.backward_mode)
        q._caches = {"gate_up": WeightCache(), "down": WeightCache()}
        q.path = getattr(experts, "path", None)
        q.rowwise = experts.rowwise
        q.set_hold_bf16(experts.hold_bf16)  # a bf16 projection's held copy, kept operands
        return q

    def set_hold_bf16(self, hold: bool) -> None:
        """GroupedExperts' held bf16 copies (of a bf16 projection), and for a quantized one the
        bf16 operand its weight keeps per optimizer step (`kept_forms`); either way from empty
        caches."""
        super().set_hold_bf16(hold)
        for cache in getattr(self, "_caches", {}).values():
            cache.clear()

    def _grouped_specs(self) -> dict:
        return {k: None if s.format is Format.BF16 else s for k, s in self.specs.items()}

    def qweight(self, which: str, gemm: Gemm) -> QWeight:
        """Projection `which`'s quantized weight as the `gemm` path builds it (the grouped
        GEMMs for TENSOR_CORE), cached until the parameter changes. A column-wise copy only
        for MXFP8's quantized backward: block FP8's grouped dgrad reads the forward's codes
        transposed in place (strides), the reference's their DEQ."""
        param = self.gate_up_proj if which == "gate_up" else self.down_proj
        args = (gemm, param, self.specs[which], None, self.backward_mode, self.backend)
        held = self.hold_bf16 and gemm is Gemm.TENSOR_CORE
        kept = kept_forms(self.backward_mode) if held else ()

        def build() -> QWeight:
            return path_weight(*args, grouped=True).keep_operands(*kept)

        return self._caches[which].get((param,), build, kind=(gemm, kept))

    def _grouped_proj(self, which: str, x_sorted: torch.Tensor, layout) -> torch.Tensor:
        spec = self.specs[which]
        if spec.format is Format.BF16:
            return super()._grouped_proj(which, x_sorted, layout)
        param = self.gate_up_proj if which == "gate_up" else self.down_proj
        tw = self.qweight(which, Gemm.TENSOR_CORE)
        tokens = which == "gate_up" and layout.gate_up_tokens  # x's tokens, gathered there
        args = (spec, self.backward_mode, self.backend, layout, tokens)
        with no_autocast(x_sorted.device):
            return path_for(Gemm.TENSOR_CORE).grouped(x_sorted, tw, param, *args)

    def _run(self, which: str, e: int, x: torch.Tensor) -> torch.Tensor:
        spec = self.specs[which]
        param = self.gate_up_proj if which == "gate_up" else self.down_proj
        if spec.format is Format.BF16:
            return nn.functional.linear(x, param[e])
        wq = self.qweight(which, Gemm.REFERENCE).for_expert(e)
        args = (spec, self.backward_mode, self.backend)
        with no_autocast(x.device):
            return path_for(Gemm.REFERENCE).linear(x, wq, param[e], *args)

    def _gate_up(self, e: int, x_nH: torch.Tensor) -> torch.Tensor:
        return self._run("gate_up", e, x_nH)

    def _down(self, e: int, h_nI: torch.Tensor) -> torch.Tensor:
        return self._run("down", e, h_nI)

    def extra_repr(self) -> str:
        fmts = ", ".join(f"{k}={v.format}" for k, v in self.specs.items())
        return f"{super().extra_repr()}, {fmts}, backward={self.backward_mode}"
