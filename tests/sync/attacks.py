"""Forged updates, shared by the in-process tampering tests and the distributed worker: each
takes the buckets of an honest export under the MIXED plan (tests/sync/helpers.py: MXFP8,
block FP8, NVFP4 per tensor, per expert and per half, bf16) and returns buckets in which one or
two records are not what the plan says. Where a record's value changes, its checksum is
recomputed for its name (`forged`), as anyone who can run mxrl can do: only the checks against
the plan can refuse it. A swap moves two records' values *with* their checksums, each valid for
the other name.

`ATTACKS`: (id, forge, the tensor the refusal must name, a regex of the in-process message).
`engine_state` is what a refusal must leave unchanged: the bytes of every weight, the verified
hashes, `weights_version` and `weights_step`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable

import torch

from mxrl.formats import QTensor, dequantize, quantize
from mxrl.weights import Bucket, WeightRecord, checksum, stored_tensors

L = "model.layers.{}."
ROUTER = L + "mlp.gate.weight"  # bf16 [8, 64]
Q_PROJ = L + "self_attn.q_proj.weight"  # mxfp8 [64, 64]
O_PROJ = L + "self_attn.o_proj.weight"  # fp8_block 32x32 [64, 64]
GATE_UP = L + "mlp.experts.gate_up_proj"  # nvfp4 [8, 64, 64]: global scale [8, 1, 1] in layers
# 0-1 (fused), [8, 64, 1] in layers 2-3 (one per half)
SHARED_GATE = L + "mlp.shared_expert.gate_proj.weight"  # nvfp4 [64, 64], fused with up: []
SHARED_DOWN = L + "mlp.shared_expert.down_proj.weight"  # nvfp4 [64, 64]: global scale []

Forge = Callable[[list[Bucket]], list[Bucket]]


def forged(name: str, value) -> WeightRecord:
    """A record whose checksum is right for its name and value."""
    return WeightRecord(name, value, checksum(name, value))


def _map(buckets: list[Bucket], how: Callable[[WeightRecord], WeightRecord]) -> list[Bucket]:
    return [dataclasses.replace(b, records=tuple(how(r) for r in b.records)) for b in buckets]


def value_of(buckets: list[Bucket], name: str):
    return next(r.value for b in buckets for r in b.records if r.name == name)


def replaced(name: str, make: Callable) -> Forge:
    """Record `name`'s value replaced by make(value), its checksum recomputed."""

    def forge(buckets):
        return _map(buckets, lambda r: forged(r.name, make(r.value)) if r.name == name else r)

    return forge


def swapped(a: str, b: str) -> Forge:
    """Records a and b exchange their values and their checksums (each valid for the other)."""

    def forge(buckets):
        by_name = {r.name: r for bucket in buckets for r in bucket.records}
        ra, rb = by_name[a], by_name[b]
        return _map(
            buckets,
            lambda r: (
                WeightRecord(a, rb.value, rb.hash)
                if r.name == a
                else WeightRecord(b, ra.value, ra.hash)
                if r.name == b
                else r
            ),
        )

    return forge


def bypass(q: QTensor, **fields) -> QTensor:
    """A copy of q with fields set without QTensor's own checks (what arrives can be anything:
    the engine must not rely on a value having been built through its constructor)."""
    out = dataclasses.replace(q)
    for key, value in fields.items():
        object.__setattr__(out, key, value)
    return out


def with_global_scale(at, value: float):
    def make(q: QTensor) -> QTensor:
        gs = q.global_scale.clone()
        gs[at] = value
        return dataclasses.replace(q, global_scale=gs)

    return make


def _column_wise(q: QTensor) -> QTensor:
    return quantize(dequantize(q), "mxfp8", axis=0)


def _unshared(q: QTensor) -> QTensor:
    return dataclasses.replace(q, global_scale=q.global_scale * 2)


ATTACKS: list[tuple[str, Forge, str, str]] = [
    # swapped records, each with its own (valid) checksum: the name is inside the checksum
    ("swap_bf16", swapped(ROUTER.format(0), ROUTER.format(1)), ROUTER.format(0),
     "checksum mismatch"),
    ("swap_nvfp4_experts", swapped(GATE_UP.format(0), GATE_UP.format(1)), GATE_UP.format(0),
     "checksum mismatch"),
    ("swap_mxfp8", swapped(Q_PROJ.format(0), Q_PROJ.format(1)), Q_PROJ.format(0),
     "checksum mismatch"),
    ("swap_fp8_block", swapped(O_PROJ.format(0), O_PROJ.format(1)), O_PROJ.format(0),
     "checksum mismatch"),
    # fields whose shape is not the plan's
    ("truncated_scale_nvfp4", replaced(GATE_UP.format(0), lambda q: dataclasses.replace(
        q, scale=q.scale[..., :-1].contiguous())), GATE_UP.format(0),
     r"scale must be float8_e4m3fn \(8, 64, 4\).*got float8_e4m3fn \(8, 64, 3\)"),
    ("truncated_scale_mxfp8", replaced(Q_PROJ.format(0), lambda q: dataclasses.replace(
        q, scale=q.scale[:-1].contiguous())), Q_PROJ.format(0),
     r"scale must be float8_e8m0fnu \(64, 2\).*got float8_e8m0fnu \(63, 2\)"),
    ("truncated_scale_fp8_block", replaced(O_PROJ.format(0), lambda q: dataclasses.replace(
        q, scale=q.scale[:, :-1].contiguous())), O_PROJ.format(0),
     r"scale must be float32 \(2, 2\).*got float32 \(2, 1\)"),
    ("scalar_global_scale_per_expert", replaced(GATE_UP.format(0), lambda q: dataclasses.replace(
        q, global_scale=q.global_scale.reshape(-1)[0].clone())), GATE_UP.format(0),
     r"global_scale must be float32 \(8, 1, 1\).*got float32 \(\)"),
    ("scalar_global_scale_per_half", replaced(GATE_UP.format(2), lambda q: dataclasses.replace(
        q, global_scale=q.global_scale.reshape(-1)[0].clone())), GATE_UP.format(2),
     r"global_scale must be float32 \(8, 64, 1\).*got float32 \(\)"),
    ("per_row_global_scale_per_tensor", replaced(SHARED_DOWN.format(0),
     lambda q: dataclasses.replace(q, global_scale=q.global_scale.expand(64, 1).contiguous())),
     SHARED_DOWN.format(0), r"global_scale must be float32 \(\).*got float32 \(64, 1\)"),
    ("column_wise_mxfp8", replaced(Q_PROJ.format(0), _column_wise), Q_PROJ.format(0),
     "column-wise copy"),
    # values of the global scales
    ("nan_global_scale", replaced(GATE_UP.format(0), with_global_scale((3, 0, 0), float("nan"))),
     GATE_UP.format(0), "global_scale must be finite and positive.*got nan at index \\(3, 0, 0\\)"),
    ("inf_global_scale", replaced(SHARED_DOWN.format(1), with_global_scale((), float("inf"))),
     SHARED_DOWN.format(1), "global_scale must be finite and positive.*got inf"),
    ("zero_global_scale", replaced(GATE_UP.format(2), with_global_scale((1, 5, 0), 0.0)),
     GATE_UP.format(2), r"finite and positive.*got 0\.0 at index \(1, 5, 0\)"),
    ("negative_global_scale", replaced(GATE_UP.format(1), lambda q: dataclasses.replace(
        q, global_scale=-q.global_scale)), GATE_UP.format(1), "finite and positive.*got -"),
    ("unshared_gate_up", replaced(SHARED_GATE.format(0), _unshared), SHARED_GATE.format(0),
     "share one NVFP4 global scale"),
    # dtypes of each field
    ("qdata_dtype", replaced(Q_PROJ.format(1), lambda q: bypass(
        q, qdata=q.qdata.view(torch.int8))), Q_PROJ.format(1),
     r"qdata must be uint8 \(64, 64\).*got int8 \(64, 64\)"),
    ("scale_dtype", replaced(O_PROJ.format(1), lambda q: bypass(
        q, scale=q.scale.to(torch.float16))), O_PROJ.format(1),
     r"scale must be float32 \(2, 2\).*got float16 \(2, 2\)"),
    ("global_scale_dtype", replaced(GATE_UP.format(1), lambda q: bypass(
        q, global_scale=q.global_scale.double())), GATE_UP.format(1),
     r"global_scale must be float32 \(8, 1, 1\).*got float64 \(8, 1, 1\)"),
    ("plain_dtype", replaced(ROUTER.format(2), lambda t: t.to(torch.float16)), ROUTER.format(2),
     r"plain \(8, 64\) tensor of torch\.bfloat16.*got float16 \(8, 64\)"),
]  # fmt: skip
ATTACK_IDS = [a[0] for a in ATTACKS]


def engine_state(engine) -> tuple:
    """(weights_version, weights_step, the verified hashes, sha256 of every stored byte)."""
    h = hashlib.sha256()
    for name in sorted(engine.weights):
        for key, t in stored_tensors(engine.weights[name]).items():
            h.update(f"{name}.{key}".encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return engine.weights_version, engine.weights_step, dict(engine.hashes), h.hexdigest()


def names_the_tensor(message: str, name: str) -> bool:
    return re.search(re.escape(name) + r"\b", message) is not None
