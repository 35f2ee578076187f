"""Served checkpoints: the engine's bytes in the layouts serving stacks load.

`mxrl convert --to hf` writes an HF checkpoint directory that transformers, vLLM and SGLang
read, holding the codes and scales the rollout engine holds, byte for byte (docs/checkpoints.md):

| plan's formats   | quantization_config                 | tensors of a quantized Linear `M`        |
|------------------|-------------------------------------|------------------------------------------|
| fp8_block        | HF fine-grained FP8 (`fp8`)         | `M.weight` float8_e4m3fn [N, K],         |
|                  |                                     | `M.weight_scale_inv` fp32 [N/bn, K/bk]   |
| mxfp8            | compressed-tensors `mxfp8-quantized`| `M.weight` float8_e4m3fn [N, K],         |
|                  |                                     | `M.weight_scale` uint8 (E8M0) [N, K/32]  |
| nvfp4            | compressed-tensors                  | `M.weight_packed` uint8 [N, K/2],        |
|                  | `nvfp4-pack-quantized`              | `M.weight_scale` float8_e4m3fn [N, K/16],|
|                  |                                     | `M.weight_global_scale` fp32 [1] (S_enc) |

Routed experts are written per expert (`mlp.experts.{e}.{gate,up,down}_proj`), as published
checkpoints are; a fused gate_up QTensor is cut at row I (its gate and up halves keep their
codes, block scales and global scale). bf16 tensors are written as the export casts them. The
recipe's bf16 exceptions among the Linear modules become the format's ignore list
(`modules_to_not_convert` / `ignore`).

What the files cannot say: NVFP4 activations. compressed-tensors' NVFP4 activation scheme reads
one static, calibrated global scale per Linear (`input_global_scale`); mxrl's recipe computes a
global scale per token at run time, which no field expresses. The export writes the
weight-only NVFP4 scheme (serving engines then run bf16 activations through exactly these
weights) and records the recipe's activation contract under config.json's `mxrl` key.
MXFP8 activations (1x32 blocks, dynamic) and block-FP8 activations (1x128 groups, dynamic) are
what the formats state.

Refused before a byte is written (`served_format`): a plan that mixes fp8_block with
mxfp8/nvfp4, a quantized embedding or lm_head, an fp8_block fused gate_up whose gate/up boundary
falls inside a block row; while writing: an NVFP4 global scale that differs between the rows of
one written Linear.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from mxrl.arch.names import Kind
from mxrl.formats import QTensor
from mxrl.formats.constants import Format
from mxrl.models.hf_checkpoint import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME
from mxrl.models.hf_save import copy_side_files, parse_size, staged
from mxrl.recipe import Plan, TensorSpec
from mxrl.weights.buckets import Export
from mxrl.weights.quantized_checkpoint import check_complete, checked_record
from mxrl.weights.record import WeightRecord
from mxrl.weights.served_config import (
    DOWN,
    GATE_UP,
    ServedFormat,
    precision_contract,
    quantization_config,
)

logger = logging.getLogger(__name__)


def served_format(plan: Plan) -> ServedFormat:
    """The served layout of `plan`, or ValueError naming a tensor the layouts cannot express."""
    quantized = [s for s in plan.values() if s.format is not Format.BF16]
    for spec in quantized:
        if spec.kind in (Kind.EMBEDDING, Kind.LM_HEAD):
            raise ValueError(
                f"cannot export {spec.name} ({spec.format}) to a served checkpoint: the served "
                f"layouts quantize Linear layers only and keep {spec.kind} in bf16; make it bf16 "
                "in the recipe"
            )
    fp8 = [s for s in quantized if s.format is Format.FP8_BLOCK]
    mx = [s for s in quantized if s.format in (Format.MXFP8, Format.NVFP4)]
    if fp8 and mx:
        raise ValueError(
            f"cannot export plan {plan.hash()[:12]} to one served checkpoint: {fp8[0].name} is "
            f"fp8_block (HF fine-grained FP8) and {mx[0].name} is {mx[0].format} "
            "(compressed-tensors); no layout vLLM and SGLang both read holds both. Export a "
            "recipe with one family of formats"
        )
    blocks = {s.block for s in fp8}
    if len(blocks) > 1:
        raise ValueError(
            f"cannot export plan {plan.hash()[:12]}: fp8_block tensors use blocks "
            f"{sorted(blocks)}, and weight_block_size is one per checkpoint; use one block size"
        )
    by_layer: dict[str, TensorSpec] = {}
    for spec in plan.values():
        if spec.name.endswith((GATE_UP, DOWN)):
            other = by_layer.setdefault(spec.name.rsplit(".", 1)[0], spec)
            if other.format is not spec.format:
                raise ValueError(
                    f"cannot export {spec.name} ({spec.format}) beside {other.name} "
                    f"({other.format}): serving engines quantize a layer's experts as one module, "
                    "in one format; give both the same format in the recipe"
                )
    if fp8:
        return ServedFormat.HF_FP8
    return ServedFormat.COMPRESSED_TENSORS if mx else ServedFormat.NONE


def served_tensors(name: str, value: QTensor | torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, tensor) for one exported record, per expert where the model fuses them;
    the tensors are views of the record's (bytes reinterpreted, never converted)."""
    for module, part in _modules(name, value):
        if isinstance(part, QTensor):
            yield from _quantized(module, name, part)
        elif module is None:
            yield name, part
        else:
            yield f"{module}.weight", part


def _modules(name: str, value: QTensor | torch.Tensor):
    """(Linear module name or None, the value's part it holds)."""
    if name.endswith((GATE_UP, DOWN)):
        prefix = name.rsplit(".", 1)[0]
        num_experts = value.shape[0]
        for e in range(num_experts):
            if name.endswith(DOWN):
                yield f"{prefix}.{e}.down_proj", _select(value, e, None)
                continue
            inter = value.shape[1] // 2
            yield f"{prefix}.{e}.gate_proj", _select(value, e, (0, inter))
            yield f"{prefix}.{e}.up_proj", _select(value, e, (inter, 2 * inter))
    elif name.endswith(".weight") and len(value.shape) == 2 and "norm" not in name:
        yield name.removesuffix(".weight"), value
    else:
        yield None, value


def _select(value: QTensor | torch.Tensor, expert: int, rows: tuple[int, int] | None):
    """Matrix `expert` of a stacked [E, R, K] value, rows [lo, hi) of it when given."""
    lo, hi = rows if rows is not None else (0, value.shape[1])
    if not isinstance(value, QTensor):
        return value[expert, lo:hi]
    br = value.block[0]
    gs = value.global_scale
    if gs is not None and gs.dim():
        gs = gs[expert]
        if gs.shape[0] > 1:  # one per row: a fused gate_up's halves, each repeated over its rows
            gs = gs[lo:hi]
    return QTensor(
        value.qdata[expert, lo:hi],
        value.scale[expert, lo // br : -(-hi // br)],
        value.fmt,
        torch.Size((hi - lo, value.shape[-1])),
        value.axis,
        gs,
    )


def _quantized(module: str, name: str, q: QTensor):
    if q.fmt is Format.FP8_BLOCK:
        yield f"{module}.weight", q.qdata.view(torch.float8_e4m3fn)
        yield f"{module}.weight_scale_inv", q.scale
    elif q.fmt is Format.MXFP8:
        yield f"{module}.weight", q.qdata.view(torch.float8_e4m3fn)
        yield f"{module}.weight_scale", q.scale.view(torch.uint8)
    else:
        gs = q.global_scale
        if gs.numel() > 1 and not bool((gs == gs.reshape(-1)[0]).all()):
            raise ValueError(
                f"cannot export {name}: {module} would need one NVFP4 global scale, but its rows "
                "hold different ones; compressed-tensors stores one per Linear"
            )
        yield f"{module}.weight_packed", q.qdata
        yield f"{module}.weight_scale", q.scale
        yield f"{module}.weight_global_scale", gs.reshape(-1)[:1]


def write_served_checkpoint(
    records: Iterable[WeightRecord] | Export,
    plan: Plan,
    config: dict[str, Any],
    out_dir: str | Path,
    shard_bytes: int | str = "5GB",
    *,
    overwrite: bool = False,
    copy_files_from: str | Path | None = None,
    progress: bool | None = None,
    check: Callable[[], None] | None = None,
) -> Path:
    """Write one export's records (every tensor of `plan`) as a served checkpoint in `out_dir`
    (module docstring); return its path. Built in a temporary sibling, renamed into place at the
    end: a refused or failed export leaves nothing behind and changes nothing that was there.

    config: the source HF config dict; config.json gets `quantization_config`, `mxrl` and the
    bf16 tensors' dtype. Raises ValueError for a plan the layouts cannot express (before a byte
    is written), records that do not match the plan, or a checksum mismatch."""
    fmt = served_format(plan)
    out = Path(out_dir)
    limit = parse_size(shard_bytes)
    with staged(out, overwrite=overwrite, flag="--overwrite") as tmp:
        stream = records.records() if isinstance(records, Export) else iter(records)
        bf16_dtype = _write_shards(tmp, stream, plan, limit, progress)
        served = {k: v for k, v in config.items() if k not in ("quantization_config", "mxrl")}
        served["torch_dtype"] = str(bf16_dtype).removeprefix("torch.")
        served.pop("dtype", None)
        qc = quantization_config(plan, fmt)
        if qc is not None:
            served["quantization_config"] = qc
        served["mxrl"] = precision_contract(plan)
        (tmp / CONFIG_NAME).write_text(json.dumps(served, indent=2, sort_keys=True) + "\n")
        if copy_files_from is not None:
            copy_side_files(copy_files_from, tmp)
        if check is not None:
            check()  # the caller's last word (e.g. the engine's digest) before it is in place
    logger.info("wrote a %s served checkpoint of %d tensors to %s", fmt, len(plan), out)
    return out


def _write_shards(
    tmp: Path,
    records: Iterator[WeightRecord],
    plan: Plan,
    limit: int,
    progress: bool | None,
) -> torch.dtype:
    """Stream the records into `.partial` shards, then name them as HF does; returns the dtype
    of the bf16 tensors."""
    seen: set[str] = set()
    written: list[tuple[Path, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    size = total = 0
    bf16_dtype = torch.bfloat16
    show = sys.stderr.isatty() if progress is None else progress

    def flush() -> None:
        path = tmp / f"shard-{len(written) + 1:05d}.partial"
        save_file(pending, str(path), metadata={"format": "pt"})
        written.append((path, list(pending)))

    with tqdm(total=len(plan), unit="tensor", desc="exporting", disable=not show) as bar:
        for record in records:
            checked_record(record, plan, seen)
            seen.add(record.name)
            if not isinstance(record.value, QTensor) and record.value.is_floating_point():
                bf16_dtype = record.value.dtype
            for key, t in served_tensors(record.name, record.value):
                nbytes = t.numel() * t.element_size()
                if pending and size + nbytes > limit:
                    flush()
                    pending, size = {}, 0
                pending[key] = t.detach().to("cpu", copy=True).contiguous()
                size += nbytes
                total += nbytes
            bar.update()
        if pending:
            flush()
    check_complete(plan, seen)
    n = len(written)
    weight_map: dict[str, str] = {}
    for i, (path, keys) in enumerate(written, start=1):
        final = WEIGHTS_NAME if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        path.rename(tmp / final)
        weight_map.update(dict.fromkeys(keys, final))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return bf16_dtype
