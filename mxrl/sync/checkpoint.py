"""Quantized checkpoints: the bytes the engine holds, on disk, with a manifest of hashes.

A directory written by `write_quantized_checkpoint` (what `mxrl convert` makes):

    config.json                         the source HF config, verbatim
    plan.json                           Plan.to_json(): every tensor's spec, with the plan hash
    manifest.json                       every tensor's shard, format, shape, bytes, content hash,
                                        keys; every shard's size and sha256; the quantization event
    model-00001-of-0000N.safetensors    QTensor fields (`{name}.qdata`, `{name}.scale`,
    ...                                 `{name}.global_scale`); bf16 tensors under their own name
    tokenizer files                     copied from the source when present

The records come from the one export path (`mxrl.engine.export_weights`, usually through
`mxrl.sync.export`), so a checkpoint holds exactly the bytes a live sync would send. Shards are
filled in plan order until the next tensor would pass `shard_bytes` (a bigger tensor gets its own
shard), written one by one, and the directory is built in a temporary sibling that is renamed
into place at the end: a failed conversion leaves nothing half-written.

`read_quantized_checkpoint` checks file sizes up front and each shard's sha256 before using its
tensors, and yields records carrying the manifest's content hashes, which `Engine.load_weights`
recomputes; an error names the file and, when the file still parses, the tensor.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from mxrl import __version__
from mxrl.engine import Engine
from mxrl.engine.checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    MANIFEST_NAME,
    PLAN_NAME,
    read_quantized_checkpoint,
    sha256_file,
)
from mxrl.engine.weights import WeightRecord, content_hash
from mxrl.formats import QTensor
from mxrl.models import from_pretrained, parse_size
from mxrl.models.checkpoint import CONFIG_NAME, copy_side_files, move_into_place
from mxrl.recipe import Plan, Recipe, load_hf_config, resolve, tensors_from_hf_config
from mxrl.sync.export import DEFAULT_BUCKET_BYTES, Export, export

logger = logging.getLogger(__name__)

# The reader lives in the engine room (Engine.from_checkpoint); re-exported for the sync API.
__all__ = [
    "MANIFEST_NAME",
    "PLAN_NAME",
    "convert_checkpoint",
    "load_engine_from_checkpoint",
    "read_quantized_checkpoint",
    "write_quantized_checkpoint",
]

DEFAULT_SHARD_BYTES = 2 * 10**9


def write_quantized_checkpoint(
    records: Iterable[WeightRecord] | Export,
    plan: Plan,
    config: dict[str, Any],
    out_dir: str | Path,
    shard_bytes: int | str = DEFAULT_SHARD_BYTES,
    *,
    overwrite: bool = False,
    copy_files_from: str | Path | None = None,
    progress: bool | None = None,
) -> Path:
    """Write the records of one export (every tensor of `plan`, in any order) as a quantized
    checkpoint in `out_dir` (module docstring); return its path.

    records: WeightRecords, or an `Export` (its QuantizationEvent then goes into the manifest).
    config: the HF config dict (written as config.json). shard_bytes: bytes or "2GB"/"500MiB".
    overwrite: replace an existing non-empty directory once the new one is complete.
    copy_files_from: an HF directory whose tokenizer / generation files are copied.
    progress: tqdm bar (None: when stderr is a terminal). Raises ValueError for records that do
    not match the plan (unknown, duplicated, missing tensors; content hash mismatch).
    """
    out = Path(out_dir)
    limit = parse_size(shard_bytes)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise ValueError(
            f"{out} exists and is not an empty directory; pass overwrite=True (--overwrite) to "
            "replace it, or write to a new directory"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        stream = records.records() if isinstance(records, Export) else iter(records)
        tensors, shards = _write_shards(tmp, stream, plan, limit, progress)
        missing = [n for n in plan if n not in tensors]
        if missing:
            raise ValueError(
                f"the records lack {len(missing)} tensor(s) of the plan, e.g. {missing[:3]}; "
                "export every tensor of the plan"
            )
        event = records.event.to_dict() if isinstance(records, Export) else None
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "mxrl_version": __version__,
            "recipe": plan.recipe_name,
            "plan_hash": plan.hash(),
            "num_tensors": len(tensors),
            "num_bytes": sum(t["bytes"] for t in tensors.values()),
            "quantization_event": event,
            "shards": shards,
            "tensors": {n: tensors[n] for n in plan},  # plan order
        }
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / PLAN_NAME).write_text(plan.to_json(indent=2) + "\n")
        (tmp / MANIFEST_NAME).write_text(_manifest_text(manifest))
        if copy_files_from is not None:
            copy_side_files(copy_files_from, tmp)
        _default_permissions(tmp)
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %d tensors in %d shard(s) to %s", len(tensors), len(shards), out)
    return out


def _manifest_text(manifest: dict[str, Any]) -> str:
    """Indented JSON with one line per tensor (a 30B model's manifest stays readable)."""
    head = {k: v for k, v in manifest.items() if k != "tensors"}
    lines = [f"    {json.dumps(n)}: {json.dumps(t)}" for n, t in manifest["tensors"].items()]
    body = json.dumps(head, indent=2)[:-2]
    return body + ',\n  "tensors": {\n' + ",\n".join(lines) + "\n  }\n}\n"


def _default_permissions(tmp: Path) -> None:
    """mkdtemp makes a 0700 directory (and safetensors 0600 files): give the checkpoint the
    permissions of any file this process creates, so other users and jobs can read it."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)


def _write_shards(
    tmp: Path, records: Iterator[WeightRecord], plan: Plan, limit: int, progress: bool | None
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    tensors: dict[str, dict[str, Any]] = {}
    written: list[tuple[Path, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    names: list[str] = []
    size = 0
    show = sys.stderr.isatty() if progress is None else progress

    def flush() -> None:
        path = tmp / f"shard-{len(written) + 1:05d}.partial"
        save_file(pending, str(path), metadata={"format": CHECKPOINT_FORMAT})
        written.append((path, list(names)))
        bar.set_postfix_str(f"shard {len(written)}")

    with tqdm(total=len(plan), unit="tensor", desc="converting", disable=not show) as bar:
        for record in records:
            spec = plan.get(record.name)
            if spec is None:
                raise ValueError(f"{record.name!r} is not a tensor of the plan")
            if record.name in tensors:
                raise ValueError(f"{record.name} appears twice in the records")
            if content_hash(record.value) != record.hash:
                raise ValueError(f"{record.name}: content hash mismatch; re-export it")
            if names and size + record.nbytes > limit:
                flush()
                pending, names, size = {}, [], 0
            state = _state_dict(record)
            pending.update(state)
            names.append(record.name)
            size += record.nbytes
            tensors[record.name] = {
                "shard": None,  # set below, once the number of shards is known
                "format": str(spec.format),
                "shape": list(spec.shape),
                "bytes": record.nbytes,
                "hash": record.hash,
                "keys": list(state),
            }
            bar.update()
        if names:
            flush()
    n = len(written)
    shards: dict[str, dict[str, Any]] = {}
    for i, (path, shard_names) in enumerate(written, start=1):
        final = f"model-{i:05d}-of-{n:05d}.safetensors"
        path.rename(tmp / final)
        shards[final] = {
            "bytes": (tmp / final).stat().st_size,
            "sha256": sha256_file(tmp / final),
            "num_tensors": len(shard_names),
        }
        for name in shard_names:
            tensors[name]["shard"] = final
    return tensors, shards


def _state_dict(record: WeightRecord) -> dict[str, torch.Tensor]:
    """Fresh contiguous CPU tensors (safetensors refuses views that share storage)."""
    v = record.value
    state = v.to_state_dict(record.name) if isinstance(v, QTensor) else {record.name: v}
    return {k: t.detach().to("cpu", copy=True).contiguous() for k, t in state.items()}


# --- conversion ----------------------------------------------------------------------------------
_LOAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert_checkpoint(
    model_dir: str | Path,
    recipe: Recipe | str | Path,
    out_dir: str | Path,
    *,
    shard_bytes: int | str = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool | None = None,
    strict: bool = True,
    on_plan: Callable[[Plan], None] | None = None,
) -> Path:
    """HF checkpoint -> quantized checkpoint (what `mxrl convert` runs); returns out_dir.

    The plan is resolved on config.json first and handed to `on_plan` (the CLI prints its
    summary), then checked (`Plan.check`: strict refuses a recipe that does not do what it
    says on this model), all before a byte is read or written.

    The weights are loaded in the checkpoint's own dtype (config.json `dtype` / `torch_dtype`;
    float32 when absent), which every quantizer reads exactly, so the bytes equal a live export
    of the same values. The plan is `recipe` resolved on the model's parameters.
    """
    model_dir = Path(model_dir)
    try:
        shard_bytes = parse_size(shard_bytes)
    except ValueError:
        raise ValueError(
            f"shard size {shard_bytes!r} is not a positive byte count or a size such as '2GB', "
            "'500MB' or '2GiB'"
        ) from None
    if not model_dir.is_dir():
        raise ValueError(f"--model {str(model_dir)!r} is not a directory (an HF checkpoint)")
    config = load_hf_config(model_dir)
    # Resolve on the config first: a bad recipe fails before gigabytes are read.
    first = resolve(recipe, tensors_from_hf_config(config, expert_layout="fused"))
    if on_plan is not None:
        on_plan(first)
    first.check(strict=strict)
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    model = from_pretrained(model_dir, dtype=_LOAD_DTYPES.get(str(stored), torch.float32))
    plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
    updates = export(model, plan, bucket_bytes=DEFAULT_BUCKET_BYTES)
    return write_quantized_checkpoint(
        updates,
        plan,
        config,
        out_dir,
        shard_bytes,
        overwrite=overwrite,
        copy_files_from=model_dir,
        progress=progress,
    )


def load_engine_from_checkpoint(path: str | Path, **engine_kwargs: Any) -> Engine:
    """`Engine.from_checkpoint` (kept here for callers of the sync room)."""
    return Engine.from_checkpoint(path, **engine_kwargs)
