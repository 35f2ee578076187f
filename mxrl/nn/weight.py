"""One quantized weight (`QWeight`) and its per-step cache (`WeightCache`): docs/nn.md, "The
quantized weight"; docs/design.md §4.5.

Legend: w [N, K] (or [E, N, K] for routed experts) the master weight, q its row-wise QTensor.

A QWeight holds q, the contract bytes (what the forward GEMM, export and weight sync read), and
derives each GEMM operand from it by role (`Form`: LP the forward's, DEQ the dequantized
backward's, COL the quantized backward's column-wise copy) and dtype when a GEMM asks
(`operand`). What it keeps between calls is explicit: the operands a path `hold`s (the reference
path's fp32 LP, DEQ and COL, kept from the build to the next optimizer step; the engine's fp32
LP and DEQ, from one load to the next) and the column-wise QTensor once made (`col`). The
tensor-core path holds nothing derived: each bf16 operand is written from the packed bytes by
`mxrl.kernels.dequantize` for its GEMM and freed after it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mxrl.formats import QTensor, decode_global_scale
from mxrl.formats.constants import Format
from mxrl.formats.fp8_block import transpose_square_blocks
from mxrl.kernels import Backend
from mxrl.kernels import dequantize as kernel_dequantize
from mxrl.kernels import quantize as kernel_quantize
from mxrl.nn.operands import Form
from mxrl.recipe import TensorSpec
from mxrl.recipe.quantize import weight_quantizer_kwargs

_COL = "col"  # `held`'s key of the column-wise QTensor (the operands': `_key(form, dtype)`)


def _key(form: Form, dtype: torch.dtype) -> str:
    return f"{form.value}:{dtype}"


@dataclasses.dataclass(init=False, eq=False)
class QWeight:
    """One quantized weight and the GEMM operands derived from it (module docstring).

    Its dataclass fields are the tensors it holds, nothing else (what the engine's loads copy
    in place, what a memory count sees):
    q:      the row-wise QTensor (8.25 / 4.5 / ~8 bits per weight).
    s_dec:  NVFP4 decode global scale, [] or of the weight's rank ([E, 1, 1] per expert, [N, 1]
            per row); None for formats without one.
    held:   the operands kept (`hold`, or once made for a form in `keep`), by form and dtype;
            the column-wise QTensor once `col` made it.
    Beside them: `backend`, the kernels that derive bf16 operands and quantize the column-wise
    copy (same bytes on any), and the column-wise copy's source (`from_master`'s colwise).
    """

    q: QTensor
    s_dec: torch.Tensor | None
    held: dict[str, torch.Tensor | QTensor]

    def __init__(
        self,
        q: QTensor,
        *,
        backend: Backend = Backend.REFERENCE,
        col_fn: Callable[[], QTensor] | None = None,
        s_dec: torch.Tensor | None = None,
        held: dict | None = None,
    ) -> None:
        self.q = q
        self.s_dec = decode_global_scale(q) if s_dec is None else s_dec
        self.held = {} if held is None else held
        self.backend = backend
        self._col_fn = col_fn
        # forms whose operands are kept once made (`keep_operands`), until this QWeight goes
        self.keep: frozenset[Form] = frozenset()

    @classmethod
    def from_master(
        cls,
        weight: torch.Tensor,
        spec: TensorSpec,
        partner: torch.Tensor | None = None,
        *,
        colwise: bool = False,
        backend: Backend = Backend.REFERENCE,
    ) -> QWeight:
        """From a master weight (the trainer), quantized on `backend` (same bytes on any).
        colwise: give it a column-wise copy for the quantized backward's dgrad, made when
        first asked for (`col`): MXFP8's 32x1 copy quantized from the master (refused if the
        master was written since), block FP8's w^T in the forward's square blocks."""
        w = weight.detach()
        q = kernel_quantize(
            w, spec.format, **weight_quantizer_kwargs(w, spec, partner), backend=backend
        )
        col_fn = None
        if colwise and spec.format is Format.FP8_BLOCK:
            col_fn = functools.partial(transpose_square_blocks, q)
        elif colwise:
            kwargs = weight_quantizer_kwargs(w, spec, partner, axis=-2)
            col_fn = functools.partial(_column_copy, w, w._version, spec, kwargs, backend)
        return cls(q, backend=backend, col_fn=col_fn)

    @classmethod
    def from_qtensor(cls, q: QTensor, *, backend: Backend = Backend.REFERENCE) -> QWeight:
        """From the contract bytes (the rollout engine, which never sees master weights)."""
        return cls(q, backend=backend)

    def col(self) -> QTensor | None:
        """The column-wise QTensor (None without a source), made on the first call and held
        (the tensor-core path: from the first backward to the next optimizer step)."""
        if _COL not in self.held and self._col_fn is not None:
            self.held[_COL] = self._col_fn()
        return self.held.get(_COL)

    def operand(self, form: Form, dtype: torch.dtype) -> torch.Tensor:
        """The weight's GEMM operand in `form` (LP, DEQ, COL) and `dtype`: the held one, else
        written now (`mxrl.kernels.dequantize`: `mxrl.formats.dequantize`'s bytes in any dtype,
        bf16 by `backend`'s kernel; COL from `col`, which holds its QTensor), and kept where
        `keep` names the form."""
        form = self._resolved(form)
        value = self._operand(form, dtype, self.col)
        if form in self.keep:
            self.held[_key(form, dtype)] = value
        return value

    def master_operand(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The high-precision operand (Form.HP, the high_precision backward's dgrad): the
        master this weight was quantized from, cast to `dtype`; kept where `keep` names HP
        (the master cannot change while this QWeight lives: `WeightCache`)."""
        held = self.held.get(_key(Form.HP, dtype))
        if held is not None:
            return held
        value = master.detach().to(dtype)
        if Form.HP in self.keep:
            self.held[_key(Form.HP, dtype)] = value
        return value

    def keep_operands(self, *forms: Form) -> QWeight:
        """Keep the operands of `forms` from when a GEMM first asks for them until this
        QWeight goes (a weight cache holds it until the next optimizer step): one dequantize
        (or cast, for HP) per optimizer step instead of one per GEMM, the same bytes. Returns
        self."""
        self.keep = frozenset(self._resolved(f) for f in forms)
        return self

    def _resolved(self, form: Form) -> Form:
        """DEQ is LP where the format has no global scale (MXFP8, block FP8): one tensor."""
        return Form.LP if form is Form.DEQ and self.s_dec is None else form

    def hold(self, *forms: Form, dtype: torch.dtype) -> QWeight:
        """Derive the operands of `forms` in `dtype` now and keep them; COL's QTensor is kept
        only if `col` had made it (the reference path keeps the fp32 values alone). Returns
        self."""
        for form in forms:
            self.held[_key(form, dtype)] = self._operand(form, dtype, self._col_unkept)
        return self

    def _col_unkept(self) -> QTensor | None:
        held = self.held.get(_COL)
        return held if held is not None or self._col_fn is None else self._col_fn()

    def _operand(
        self, form: Form, dtype: torch.dtype, col: Callable[[], QTensor | None]
    ) -> torch.Tensor:
        form = self._resolved(form)  # no global scale: deq is lp, one tensor
        held = self.held.get(_key(form, dtype))
        if held is not None:
            return held
        if form is Form.COL:
            q = col()
            assert q is not None, "quantized backward needs the column-wise weight copy"
            return kernel_dequantize(q, dtype=dtype, backend=self.backend)
        if form not in (Form.LP, Form.DEQ):
            raise ValueError(f"a weight has no {form} operand; it has lp, deq and col")
        gs = form is Form.DEQ
        return kernel_dequantize(self.q, global_scale=gs, dtype=dtype, backend=self.backend)

    def for_expert(self, e: int) -> QWeight:
        """The 2-D weight of expert e of a 3-D [E, N, K] one: views of its bytes and of the
        operands it holds; its column-wise copy, when not made yet, a view of this one's."""
        s = self.s_dec
        lazy_col = _COL not in self.held and self._col_fn is not None
        return QWeight(
            _expert(self.q, e),
            backend=self.backend,
            col_fn=(lambda: _expert(self.col(), e)) if lazy_col else None,
            s_dec=s[e] if s is not None and s.dim() else s,
            held={
                k: _expert(v, e) if isinstance(v, QTensor) else v[e] for k, v in self.held.items()
            },
        )


def _expert(q: QTensor, e: int) -> QTensor:
    """Expert e's 2-D QTensor of a 3-D one (the axis counted from the end, as for 2-D)."""
    gs = q.global_scale
    axis = q.axis if q.axis < 0 else q.axis - len(q.shape)
    gs = gs[e] if gs is not None and gs.dim() else gs
    return QTensor(q.qdata[e], q.scale[e], q.fmt, q.shape[1:], axis=axis, global_scale=gs)


def _column_copy(w: torch.Tensor, version: int, spec: TensorSpec, kwargs: dict, backend) -> QTensor:
    """The column-wise copy of the master weight the row-wise copy was quantized from: refused
    when the weight was written in place since (an optimizer step or a load between the
    forward and this backward). The weight's own version counter, not the process-wide
    weights epoch: an optimizer stepping other weights inside the backward (per-parameter
    optimizers in post-accumulate-grad hooks) or another model's optimizer must not refuse it.
    (FSDP2's re-gather of the same values before the backward does not move the counter:
    `weights_changed`.)"""
    if w._version != version:
        raise RuntimeError(
            f"{spec.name}: the weight was written in place (an optimizer step or a load) "
            "between the forward and the backward that needs its column-wise copy; call "
            "backward() before optimizer.step()"
        )
    return kernel_quantize(w, spec.format, **kwargs, backend=backend)


_WEIGHTS_EPOCH = [0]


def weights_changed(*_args) -> None:
    """Invalidate every WeightCache: the weights may have changed in a way their version
    counters do not show (FSDP2 all-gathers the unsharded parameter outside autograd into the
    same address step after step; a distributed checkpoint load writes the shards). Called
    after every optimizer step (a global post-step hook, below) and by loaders."""
    _WEIGHTS_EPOCH[0] += 1


register_optimizer_step_post_hook(weights_changed)


class WeightCache:
    """Holds a QWeight until one of the tensors it was built from changes (a load bumps
    the tensor's version counter), the weights epoch moves (every optimizer step,
    `weights_changed`) or another `kind` is asked for (the GEMM path: each path builds its
    own, holding what it reads): one quantization per step, not per call."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: QWeight | None = None

    def get(self, tensors: tuple[torch.Tensor, ...], build, kind=None) -> QWeight:
        per_tensor = [(t._version, t.data_ptr(), t.device, tuple(t.shape)) for t in tensors]
        key = (_WEIGHTS_EPOCH[0], kind, *per_tensor)
        if key != self._key or self._value is None:
            self._value = build()
            self._key = key
        return self._value

    def clear(self) -> None:
        self._key = self._value = None
