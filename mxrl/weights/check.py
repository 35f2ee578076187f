"""A record checked against the plan before anything trusts its bytes.

A checksum says the bytes are those the sender checksummed under that name; it does not say they
are what the plan makes of that name. `check_record` compares every field of a record with its
`TensorSpec` (metadata only: no tensor is read): a QTensor exactly when the plan quantizes the
tensor, its format, logical shape and row-wise layout (axis -1: the engine holds no column-wise
copy), and each stored field's dtype and shape as `mxrl.recipe.quantize.weight_layout` derives
them from the spec (per-tensor, per-expert or per-half NVFP4 global scale; block FP8's block);
a plain tensor's shape and dtype. `check_global_scales` then reads the NVFP4 global scales of an
update, all at once (one host read per device): each must be finite and positive (an encode
scale 2688/amax is, whatever the weights), and the two tensors of a gate/up fuse group must hold
the same one. The engine (`load_weights`, for every transport), the checkpoint writer and reader
call these; each raises ValueError naming the tensor, what the plan expects and what came.
`check_config` checks a quantized checkpoint's config.json against its plan the same way: the
model it describes must hold exactly the plan's tensors, of the plan's shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from mxrl.arch import ModelConfig
from mxrl.arch.names import keeps_fp32
from mxrl.formats import QTensor
from mxrl.formats.constants import Format
from mxrl.models import CausalLM
from mxrl.recipe import Plan, TensorSpec
from mxrl.recipe.quantize import weight_global_scale
from mxrl.weights.export import fuse_partners, spec_layout
from mxrl.weights.record import WeightRecord

_PER = {"tensor": "per tensor", "matrix": "per expert", "row": "per row (one per gate/up half)"}


def _describe(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    return f"{str(dtype).removeprefix('torch.')} {tuple(shape)}"


def _what(spec: TensorSpec) -> str:
    """The spec in words, for messages."""
    if spec.format is Format.BF16:
        return f"a plain {spec.shape} tensor"
    extra = ""
    if spec.format is Format.NVFP4:
        extra = ", one global scale " + _PER[weight_global_scale(spec)]
    elif spec.format is Format.FP8_BLOCK:
        extra = f", {spec.block} blocks"
    return f"{spec.format} {spec.shape} row-wise{extra}"


def check_record(
    record: WeightRecord, spec: TensorSpec, plain_dtype: torch.dtype | None = None
) -> None:
    """Refuse (ValueError) a record whose value is not what `spec` stores: the kind of value,
    format, shape, axis, and every field's dtype and shape. plain_dtype: the dtype of the
    tensors the plan keeps unquantized (the engine's weight dtype); None: any floating dtype.
    Reads no tensor data."""
    name, value = record.name, record.value
    assert name == spec.name, (name, spec.name)
    if not isinstance(value, (QTensor, torch.Tensor)):
        raise ValueError(
            f"{name}: a record's value is a QTensor or a tensor, got {type(value).__name__}"
        )
    quantized = spec.format is not Format.BF16
    if isinstance(value, QTensor) != quantized or (
        quantized and (value.fmt != spec.format or tuple(value.shape) != spec.shape)
    ):
        got = (
            f"a {value.fmt} QTensor of shape {tuple(value.shape)}"
            if isinstance(value, QTensor)
            else f"a plain {_describe(value.dtype, tuple(value.shape))} tensor"
        )
        raise ValueError(f"{name}: the plan stores {_what(spec)}, got {got}")
    if not quantized:
        want = torch.float32 if keeps_fp32(name) and plain_dtype is not None else plain_dtype
        if tuple(value.shape) != spec.shape or (
            (value.dtype != want) if want is not None else not value.is_floating_point()
        ):
            raise ValueError(
                f"{name}: the plan stores a plain {spec.shape} tensor"
                + (f" of {want} (export with bf16_dtype={want})" if want is not None else "")
                + f", got {_describe(value.dtype, tuple(value.shape))}"
            )
        return
    assert isinstance(value, QTensor)
    if value.axis != -1:
        raise ValueError(
            f"{name}: the plan stores {_what(spec)}, got a column-wise copy (blocks along dim "
            f"{value.axis}); send the row-wise quantization"
        )
    want_fields = spec_layout(spec)  # derived once per spec
    got_fields = value.layout()
    for key in [*want_fields, *(k for k in got_fields if k not in want_fields)]:
        want, got = want_fields.get(key), got_fields.get(key)
        if want != got:
            raise ValueError(
                f"{name}: {key} must be "
                + (_describe(*want) if want is not None else "absent")
                + f" for {_what(spec)}, got "
                + (_describe(*got) if got is not None else "none")
            )


def check_global_scales(records: Iterable[WeightRecord], plan: Plan) -> None:
    """Refuse (ValueError) an update whose NVFP4 global scales are not usable: a value that is
    NaN, ±Inf, zero or negative, or gate and up tensors of one fuse group holding different
    scales. Per device, every global scale is checked in one concatenated tensor and every pair
    in one comparison, and both flags are read to the host at once (no host sync per record);
    the records are searched on the host only on the way to an error, to name the first bad
    one. Run `check_record` first (it guarantees the shapes this compares)."""
    GlobalScaleCheck(records, plan).result()


class GlobalScaleCheck:
    """`check_global_scales` started without waiting for it: the flags are computed on each
    device at construction (queued behind the work already there), `result()` reads them (one
    host read per device) and raises as `check_global_scales` does. A caller with another host
    read to make (the engine's checksums) queues both first and waits once."""

    def __init__(self, records: Iterable[WeightRecord], plan: Plan) -> None:
        self.plan = plan
        self.scales = {
            r.name: r.value.global_scale
            for r in records
            if isinstance(r.value, QTensor) and r.value.global_scale is not None
        }
        scales = self.scales
        partners = fuse_partners(plan)
        self.pairs = [(a, b) for a, b in partners.items() if a < b and a in scales and b in scales]
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for gs in scales.values():
            by_device.setdefault(gs.device, ([], []))[0].append(gs.reshape(-1))
        for a, b in self.pairs:  # 2-D fuse pairs: one value each
            by_device.setdefault(scales[a].device, ([], []))[1].append(
                (scales[a].reshape(-1) == scales[b].reshape(-1).to(scales[a].device)).all()
            )
        self.flags = []
        for values, same in by_device.values():
            flat = torch.cat(values) if values else torch.ones(1)
            usable = (torch.isfinite(flat) & (flat > 0)).all()
            self.flags.append(torch.stack([usable, *same]) if same else usable.reshape(1))

    def result(self) -> None:
        """Read the flags (one host read per device); ValueError naming the first bad record."""
        if all(all(f.tolist()) for f in self.flags):
            return
        plan = self.plan
        for name, gs in self.scales.items():
            gs = gs.detach().cpu()
            bad = ~(torch.isfinite(gs) & (gs > 0))
            if bad.any():
                flat = int(bad.reshape(-1).nonzero()[0])
                first = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), gs.shape))
                raise ValueError(
                    f"{name}: global_scale must be finite and positive (an NVFP4 encode scale "
                    f"2688/amax) for {_what(plan[name])}, got {float(gs.reshape(-1)[flat])} at "
                    f"index {first}"
                )
        for a, b in self.pairs:
            va, vb = float(self.scales[a].reshape(-1)[0]), float(self.scales[b].reshape(-1)[0])
            if va != vb:
                raise ValueError(
                    f"{a} and {b}: gate and up share one NVFP4 global scale (fuse group "
                    f"{plan[a].fuse_group}), got {va} and {vb}"
                )
        raise AssertionError("a global-scale flag failed, but no record explains it")


def check_config(file: Path, config: dict[str, Any], plan: Plan) -> None:
    """Refuse (ValueError naming `file` and the field) a config that does not describe the model
    `plan` was resolved for (an edited field, another model's config): its layer count, and the
    names and shapes of the tensors of the model it builds (on the meta device: nothing is
    allocated), must be the plan's. The field is found by trying the config's fields at the
    values that would fit (only on the way to an error)."""
    shapes = _model_shapes(config, file)
    fix = f"copy the checkpoint's {file.name} again, or re-run mxrl convert"
    layers = ModelConfig.from_hf(config).num_hidden_layers
    if layers != plan.num_layers:
        raise ValueError(
            f"{file}: num_hidden_layers is {layers}, but the plan was resolved for a model of "
            f"{plan.num_layers} layers; {fix}"
        )
    if set(shapes) != set(plan):
        fields = _culprits(config, lambda got: set(got) == set(plan))
        extra, missing = sorted(set(shapes) - set(plan)), sorted(set(plan) - set(shapes))
        raise ValueError(
            f"{file}: {_fields(fields)} describes a model "
            + (f"with tensor(s) {extra[:3]} the plan lacks" if extra else "")
            + (" and " if extra and missing else "")
            + (f"without the plan's {missing[:3]}" if missing else "")
            + f"; {fix}"
        )
    wrong = next(((n, s.shape) for n, s in plan.items() if shapes[n] != s.shape), None)
    if wrong is not None:
        name, want = wrong
        fields = _culprits(config, lambda got: got.get(name) == want, shapes[name], want)
        raise ValueError(
            f"{file}: {_fields(fields)} gives {name} the shape {shapes[name]}, but the plan "
            f"holds it as {want}; {fix}"
        )


def _model_shapes(config: dict[str, Any], file: Path | None = None) -> dict[str, tuple[int, ...]]:
    try:
        with torch.device("meta"):  # shapes only
            model = CausalLM(ModelConfig.from_hf(config))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{file}: {e}") from None
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _culprits(
    config: dict[str, Any],
    fits: Callable[[dict[str, tuple[int, ...]]], bool],
    got: tuple[int, ...] = (),
    want: tuple[int, ...] = (),
) -> list[str]:
    """The fields which, set to a value that would fit (a flag flipped; a number scaled by the
    ratio of a dim the plan has to the one the config gives), make `fits` true."""
    tries: dict[tuple[str, Any], None] = {}
    for key, v in config.items():
        if type(v) is bool:
            tries[(key, not v)] = None
        elif type(v) is int and v > 0:
            for g, w in zip(got, want, strict=False):
                if g != w and g and (v * w) % g == 0:
                    tries[(key, v * w // g)] = None
    found = []
    for key, v in tries:
        try:
            if fits(_model_shapes({**config, key: v})) and key not in found:
                found.append(key)
        except ValueError:
            continue
    return found


def _fields(fields: list[str]) -> str:
    return "field " + " or ".join(fields) if fields else "a field"
