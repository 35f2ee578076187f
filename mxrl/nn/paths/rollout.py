"""The rollout GEMM path: the engine's weight-holding modules (module swaps of the model's
projections and experts) and batch-invariant token tiling.

Batch invariance by construction (docs/engine.md): every GEMM of these modules runs on tiles of
exactly `tile` tokens (the last one zero-padded), so each kernel sees the same shapes whatever
else is in the batch, and a row's result cannot depend on the other rows. Everything else the
model does between them is row-wise or element-wise (mxrl.nn.invariant).

Low-bit GEMMs (`uses_low_bit_gemm`): on the triton backend, NVFP4 and MXFP8 weights stay packed
(the QTensor the engine received, 4.5 / 8.25 bits per weight; no dequantized copy) and go
through `mxrl.kernels.decode_gemm`'s Triton GEMMs: the activation quantized per the plan by the
same quantizer as the trainer's, products exact, the fp32 sum in the kernel's order (within
`decode_gemm.error_bound` of the emulated GEMM). Routed experts take one grouped launch for all
experts. Each launch configuration is fixed by the weight's shape alone (the dense tile is fixed;
the grouped one is `GROUPED_CONFIG_ROWS` rows per M tile), and every output row is computed
from its own activation row only, so batch invariance holds on this path too. Block-FP8 weights
in 128x128 blocks stay packed as well (`uses_fp8_block_gemm`): dense projections run
`fp8_block_matmul` on CUDA (a tile's fixed shape fixes its cuBLAS kernel), routed experts the
grouped block-FP8 Triton kernel.
"""

from __future__ import annotations

import enum
import functools

import torch
import torch.nn.functional as F
from torch import nn

from mxrl.formats import QTensor
from mxrl.formats.constants import Format
from mxrl.kernels import Backend
from mxrl.kernels import quantize as kernel_quantize
from mxrl.kernels.backend import num_sms
from mxrl.kernels.decode_gemm import (
    GemmConfig,
    choose_config,
    default_config,
    grouped_low_bit_matmul,
    low_bit_matmul,
)
from mxrl.kernels.fp8_gemm import fp8_block_matmul, grouped_fp8_block_matmul
from mxrl.nn import invariant
from mxrl.nn.experts import GroupedExperts
from mxrl.nn.moe import moe_grouped, moe_loop
from mxrl.nn.operands import Form
from mxrl.nn.paths.expert_groups import ExpertGroups
from mxrl.nn.paths.reference import emulated_matmul
from mxrl.nn.paths.tiles import one_group, one_group_fits, padded_rows, tiled
from mxrl.nn.weight import QWeight
from mxrl.recipe import Backward, TensorSpec
from mxrl.recipe.quantize import activation_quantizer_kwargs

LOW_BIT_GEMM_FORMATS = (Format.NVFP4, Format.MXFP8)
# The grouped experts' fixed launch shape: rows per M tile (an expert with more rows loops over
# tiles) and the number of busy experts split-K is sized for (a decode step's top-k).
GROUPED_CONFIG_ROWS = 16
GROUPED_CONFIG_EXPERTS = 8


def uses_low_bit_gemm(spec: TensorSpec, backend: Backend) -> bool:
    """Whether the engine holds this weight packed and runs the low-bit GEMM (module docstring):
    the triton backend and an NVFP4 / MXFP8 weight whose K fills whole scale blocks."""
    return (
        backend is Backend.TRITON
        and spec.format in LOW_BIT_GEMM_FORMATS
        and spec.shape[-1] % (16 if spec.format is Format.NVFP4 else 32) == 0
    )


def uses_fp8_block_gemm(spec: TensorSpec, backend: Backend) -> bool:
    """Whether the engine holds this block-FP8 weight packed (codes and 128x128 block scales,
    1 byte per weight instead of a fp32 operand) and runs a block-FP8 GEMM on the codes
    (`_fp8_block`, through `RolloutPath`): the triton backend, 128x128 blocks. Every call sees
    a tile of fixed shape, so its kernel is fixed too (batch invariance)."""
    return (
        backend is Backend.TRITON
        and spec.format is Format.FP8_BLOCK
        and tuple(spec.block or ()) == (128, 128)
    )


def _row_wise(spec: TensorSpec) -> bool:
    """Whether the activation quantization of `spec` is row by row (MXFP8 1x32, block FP8
    1x128, NVFP4 per token): a row's bytes never depend on the rows quantized with it."""
    return spec.format is not Format.NVFP4 or spec.activations == "per_token"


def quantize_activation(x: torch.Tensor, spec: TensorSpec, backend: Backend) -> QTensor:
    """x [T, K] quantized as the GEMM of `spec` takes it (the trainer's quantizer options)."""
    return kernel_quantize(x, spec.format, **activation_quantizer_kwargs(spec), backend=backend)


def received_weight(q: QTensor, packed: bool, backend: Backend) -> QWeight:
    """A received weight as the engine holds it: `packed` (the low-bit or block-FP8 GEMM reads
    the QTensor itself), nothing derived; else, for the emulated GEMM (`emulated_matmul`), its
    fp32 LP and DEQ operands derived once, held until the next load copies into them
    (captured graphs read those buffers)."""
    w = QWeight.from_qtensor(q, backend=backend)
    return w if packed else w.hold(Form.LP, Form.DEQ, dtype=torch.float32)


class Grouping(enum.Enum):
    """How the engine's routed experts run: one grouped launch per projection for all experts
    (no host read: a CUDA graph can hold it), by the weights' formats (`RolloutPath.grouping`);
    None: the loop (`moe_loop`), each expert's GEMMs on tiles."""

    LOW_BIT = "low_bit"  # packed NVFP4 / MXFP8: the grouped low-bit GEMM
    FP8_BLOCK = "fp8_block"  # packed 128x128 block FP8: the grouped block-FP8 kernel
    BF16 = "bf16"  # bf16 weights computed in bf16 on sm90+: torch._grouped_mm


class RolloutPath:
    """The engine's GEMM path (docs/design.md §4.5): no autograd; every GEMM of a module on
    fixed tiles of `tile` rows (`tiled`; 0: the rows at once, `batch_invariant=False`); a weight
    held packed (`packed`) through `backend`'s low-bit or block-FP8 kernels, a QWeight's fp32
    operands through the emulated GEMM, a high-precision weight through `F.linear`; routed
    experts in one grouped launch per projection where their formats allow (`grouping`), else
    the loop with each expert's GEMMs on tiles. `RolloutLinear` and `RolloutExperts` hold one
    (`path`)."""

    autograd = False
    one_group = False  # the engine's dense_gemm="grouped" (`tiles.one_group`)

    def __init__(self, tile: int, backend: Backend) -> None:
        self.tile = tile
        self.backend = backend

    def packed(self, spec: TensorSpec) -> bool:
        """Whether a projection of `spec` is held packed, its GEMM reading the codes: the
        low-bit GEMM or block FP8's (the module docstring); otherwise a QWeight holds its fp32
        operands for the emulated GEMM."""
        return uses_low_bit_gemm(spec, self.backend) or uses_fp8_block_gemm(spec, self.backend)

    def grouping(self, specs: dict[str, TensorSpec], dtype: torch.dtype) -> Grouping | None:
        """How routed experts of these projections' specs, computed in `dtype`, run: both
        projections packed low-bit (NVFP4 with per-token activation scales only: a per-tensor
        scale belongs to one expert's tile), both block FP8 in 128x128 blocks computed in fp32
        or bf16, or both bf16 computed in bf16 on a GPU of sm90+; else None (the loop)."""
        if self.backend is not Backend.TRITON:
            return None
        formats = {spec.format for spec in specs.values()}
        if all(
            uses_low_bit_gemm(spec, self.backend)
            and (spec.format is not Format.NVFP4 or spec.activations == "per_token")
            for spec in specs.values()
        ):
            return Grouping.LOW_BIT
        if (
            dtype in (torch.float32, torch.bfloat16)
            and formats == {Format.FP8_BLOCK}
            and all(spec.block == (128, 128) for spec in specs.values())
        ):
            return Grouping.FP8_BLOCK
        if (
            dtype is torch.bfloat16
            and formats == {Format.BF16}
            and torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= (9, 0)
        ):
            return Grouping.BF16
        return None

    def linear(
        self,
        x: torch.Tensor,
        w: QWeight | torch.Tensor | None,
        master: torch.Tensor | None,
        spec: TensorSpec,
        mode: Backward | None,
        backend: Backend | None,
    ) -> torch.Tensor:
        """x [T, K] -> [T, N] in x's dtype, `tile` rows at a time; w: the QWeight received, or
        the high-precision weight (None: nothing loaded yet). The trainer's paths' signature
        (`GemmPath.linear`); `master`, `mode` and `backend` are not read: no autograd, and the
        backend is the path's, as is the packed choice (`packed(spec)`, what the module holds)."""
        if self.one_group and one_group_fits(x, w):
            return one_group(x, w)
        packed = self.packed(spec)
        if packed and isinstance(w, QWeight) and 0 < self.tile < x.shape[0] and _row_wise(spec):
            return self._packed_tiles(x, w, spec)
        matmul = functools.partial(self._matmul, w=w, spec=spec, packed=packed)
        return tiled(matmul, x, self.tile)

    def _packed_tiles(self, x: torch.Tensor, w: QWeight, spec: TensorSpec) -> torch.Tensor:
        """Several tiles through a packed weight, the bytes of `tiled` (a prefill's launches):
        the row-wise activation quantization once for every tile, then NVFP4 / MXFP8 in one
        low-bit launch at the tile's configuration (each of its M tiles computes as that tile's
        own launch: same program, same split-K order), block FP8 tile by tile on the codes, or
        in one cuBLAS call under `one_group` (invariant and the tiles' bytes as measured)."""
        t, tile = x.shape[0], self.tile
        xp = padded_rows(x, tile)
        xq = quantize_activation(xp, spec, self.backend)
        if spec.format is Format.FP8_BLOCK and self.one_group and x.is_cuda:
            return _fp8_block(xq, w.q, xp)[:t]
        if spec.format is Format.FP8_BLOCK:
            k = xq.shape[1]
            rows = [QTensor(xq.qdata[i : i + tile], xq.scale[i : i + tile], xq.fmt, (tile, k))
                    for i in range(0, xp.shape[0], tile)]  # fmt: skip
            return torch.cat([_fp8_block(q, w.q, xp[:tile]) for q in rows])[:t]
        cfg = default_config(tile, w.q, x.device)
        return low_bit_matmul(xq, w.q, out_dtype=x.dtype, backend=self.backend, config=cfg)[:t]

    def experts(
        self,
        x_TH: torch.Tensor,
        ids_Tk: torch.Tensor,
        weights_Tk: torch.Tensor,
        experts: RolloutExperts,
    ) -> torch.Tensor:
        """The routed experts' output [T, H] for the weights `experts` holds: the grouped form
        (`moe_grouped`, combined in expert order: `ExpertGroups`) by its `grouping`, else the
        loop (`moe_loop`), each expert's projections through `linear` (emulated or
        `F.linear`, on tiles) on its slice of the weights."""
        if experts.grouping is None:
            expert = functools.partial(self._expert, experts)
            return moe_loop(x_TH, ids_Tk, weights_Tk, experts.num_experts, expert)
        groups = ExpertGroups.build(ids_Tk, experts.num_experts, self.backend)
        project = functools.partial(self._grouped, experts, offsets=groups.offsets)
        return moe_grouped(x_TH, weights_Tk, groups, project)

    def graph_safe(self, module: nn.Module) -> bool:
        """Whether `module`'s forward can be captured in a CUDA graph on this path: it reads
        nothing back to the host. Routed experts only in one grouped launch per projection
        (the loop reads the per-expert counts); a projection's tiles always."""
        if isinstance(module, RolloutExperts):
            return module.grouping is not None
        return True

    def _expert(self, experts: RolloutExperts, e: int, x_nH: torch.Tensor) -> torch.Tensor:
        """Expert e on its tokens in fixed tiles (its GEMM shapes never depend on the batch),
        each projection on its slice of the held weight."""

        def project(which: str, x: torch.Tensor) -> torch.Tensor:
            v, spec = experts.values[which], experts.specs[which]
            assert v is not None, f"{spec.name}: no weights loaded"
            w = v.for_expert(e) if isinstance(v, QWeight) else v[e]
            return self._matmul(x, w=w, spec=spec, packed=False)

        def expert(x: torch.Tensor) -> torch.Tensor:
            gate, up = project("gate_up", x).chunk(2, dim=-1)
            return project("down", invariant.silu_mul(gate, up))

        return tiled(expert, x_nH, self.tile)

    def _grouped(
        self, experts: RolloutExperts, which: str, x: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """One projection for all experts, x [rows sorted by expert, K], in one launch: the
        activation quantized per the spec (the trainer's quantizer) for the packed kernels."""
        w, spec = experts.values[which], experts.specs[which]
        assert w is not None, f"{spec.name}: no weights loaded"
        if experts.grouping is Grouping.BF16:
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets[1:])
        xq = quantize_activation(x, spec, self.backend)
        if experts.grouping is Grouping.FP8_BLOCK:
            return grouped_fp8_block_matmul(xq, w.q, offsets, out_dtype=x.dtype)
        config = _grouped_config(experts.num_experts, *w.q.shape[-2:], spec.format, w.q.device)
        return grouped_low_bit_matmul(
            xq, w.q, offsets, out_dtype=x.dtype, backend=self.backend, config=config
        )

    def _matmul(
        self, x: torch.Tensor, *, w: QWeight | torch.Tensor | None, spec: TensorSpec, packed: bool
    ) -> torch.Tensor:
        """x [tile, K] -> [tile, N] in x's dtype."""
        if isinstance(w, QWeight) and packed:
            xq = quantize_activation(x, spec, self.backend)
            if spec.format is Format.FP8_BLOCK:
                return _fp8_block(xq, w.q, x)
            return low_bit_matmul(xq, w.q, out_dtype=x.dtype, backend=self.backend)
        if isinstance(w, QWeight):
            return emulated_matmul(x.float(), w, spec, self.backend)[0].to(x.dtype)
        assert w is not None, f"{spec.name}: no weights loaded"
        return F.linear(x, w)


@functools.cache
def _grouped_config(
    num_experts: int, n: int, k: int, fmt: Format, device: torch.device
) -> GemmConfig:
    """The grouped low-bit launch configuration of an [E, N, K] weight, fixed by its shape
    (batch invariance): `GROUPED_CONFIG_ROWS` rows per M tile, split-K sized for
    `GROUPED_CONFIG_EXPERTS` busy experts."""
    groups = min(num_experts, GROUPED_CONFIG_EXPERTS)
    return choose_config(GROUPED_CONFIG_ROWS, groups, n, k, num_sms(device), fmt.value)


def _fp8_block(xq: QTensor, w: QTensor, x: torch.Tensor) -> torch.Tensor:
    """Block FP8 on CUDA: `fp8_block_matmul` (torch._scaled_mm blockwise, the trainer's
    forward GEMM; a tile's shape is fixed, so is its cuBLAS kernel). Elsewhere (Triton's
    interpreter): one group of the experts' grouped kernel, w [N, K] seen as [1, N, K], all
    rows of the tile in group 0 (offsets [0, rows] built on the device). On the H200 at a
    128-row tile: 10-16 us per attention projection against 46-87 us for the one-group
    Triton launch and 20-65 us for the fp32 GEMM on the dequantized weight."""
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    n, k = w.shape
    if x.is_cuda and n % 128 == 0 and k % 128 == 0:
        return fp8_block_matmul(xq, w, out_dtype=dtype).to(x.dtype)
    w3 = QTensor(w.qdata[None], w.scale[None], w.fmt, (1, *w.shape))
    offsets = torch.arange(2, device=x.device, dtype=torch.int32) * x.shape[0]
    return grouped_fp8_block_matmul(xq, w3, offsets, out_dtype=dtype).to(x.dtype)


class _OnRolloutPath(nn.Module):
    """An engine module's backend and tile: its `RolloutPath`'s (`self.path`)."""

    path: RolloutPath

    @property
    def backend(self) -> Backend:
        return self.path.backend

    @property
    def tile(self) -> int:
        return self.path.tile


class RolloutLinear(_OnRolloutPath):
    """A projection holding what the engine received: a quantized weight (`w`, a QWeight: the
    QTensor, plus its fp32 operands where the GEMM is emulated) or a high-precision weight;
    the same emulated GEMM as the trainer's QLinear. Its GEMM runs on its `RolloutPath`, which
    decides once, by the spec and the backend, whether the weight is held packed (`packed`)."""

    def __init__(
        self, spec: TensorSpec, compute_dtype: torch.dtype, backend: Backend, tile: int
    ) -> None:
        super().__init__()
        self.spec = spec
        self.compute_dtype = compute_dtype
        self.path = RolloutPath(tile, backend)
        self.packed = self.path.packed(spec)
        self.w: QWeight | None = None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def materialize(self, value: QTensor | torch.Tensor) -> dict:
        """What `install` will set, computed without touching the module (staging): a QTensor's
        QWeight (nothing derived where the GEMM reads it packed), or the weight in the compute
        dtype."""
        if isinstance(value, QTensor):
            return {"w": received_weight(value, self.packed, self.backend), "weight": None}
        return {"w": None, "weight": value.to(self.compute_dtype)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        w = self.w if self.w is not None else self.weight
        y = self.path.linear(x2, w, None, self.spec, None, self.backend)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias


class RolloutExperts(_OnRolloutPath):
    """Routed experts holding what the engine received per projection (`values`: QWeights, or
    weights in the compute dtype); their GEMMs run on their `RolloutPath` (`path.experts`), in
    one grouped launch per projection where `grouping` says so, else expert by expert on
    fixed tiles, so that expert GEMM shapes never depend on how many tokens the batch routed
    there."""

    def __init__(
        self,
        experts: GroupedExperts,
        specs: dict[str, TensorSpec],
        dtype: torch.dtype,
        tile: int,
        backend: Backend,
    ) -> None:
        super().__init__()
        self.path = RolloutPath(tile, backend)
        self.num_experts = experts.num_experts
        self.specs = specs
        self.compute_dtype = dtype
        self.values: dict[str, QWeight | torch.Tensor | None] = dict.fromkeys(specs)
        self.grouping = self.path.grouping(specs, dtype)

    def materialize(self, which: str, value: QTensor | torch.Tensor):
        """What `values[which]` will hold for a received value (staging, nothing installed): a
        QTensor's QWeight (packed where a grouped kernel reads the codes), or the weight in the
        compute dtype."""
        if isinstance(value, QTensor):
            packed = self.grouping in (Grouping.LOW_BIT, Grouping.FP8_BLOCK)
            return received_weight(value, packed, self.backend)
        return value.to(self.compute_dtype)

    def forward(self, x_TH: torch.Tensor, ids_Tk: torch.Tensor, weights_Tk: torch.Tensor):
        return self.path.experts(x_TH, ids_Tk, weights_Tk, self)
