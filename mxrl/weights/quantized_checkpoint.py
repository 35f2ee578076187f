"""Quantized checkpoints: the bytes the engine holds, on disk, with a manifest of checksums.

A directory written by `write_quantized_checkpoint` (what `mxrl convert` makes):

    config.json                         the source HF config, verbatim
    plan.json                           Plan.to_json(): every tensor's spec, with the plan hash
    manifest.json                       every tensor's shard, format, shape, bytes, checksum,
                                        keys; every shard's size and sha256; the quantization event
    model-00001-of-0000N.safetensors    QTensor fields (`{name}.qdata`, `{name}.scale`,
    ...                                 `{name}.global_scale`); bf16 tensors under their own name
    tokenizer files                     copied from the source when present

The records come from the one export path (`mxrl.weights.export`), so a checkpoint holds exactly
the bytes a live sync would send. Shards are filled in plan order until the next tensor would
pass `shard_bytes` (a bigger tensor gets its own shard), written one by one, and the directory is
built in a temporary sibling that is renamed into place at the end: a failed conversion leaves
nothing half-written.

`read_quantized_checkpoint` checks that config.json describes the model plan.json was resolved
for (its tensors' names and shapes), file sizes up front and each shard's sha256 (a cryptographic
digest: files can be edited by anyone) before using its tensors, and every tensor's fields
against the plan (`mxrl.weights.check_record`); it yields records carrying the manifest's
checksums, which `Engine.load_weights` recomputes; an error names the file and, when the file
still parses, the tensor or the config field.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Callable, Container, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from mxrl import __version__
from mxrl.formats import QTensor
from mxrl.formats.constants import Format
from mxrl.models import parse_size
from mxrl.models.hf_checkpoint import CONFIG_NAME, open_safetensors
from mxrl.models.hf_save import copy_side_files, staged
from mxrl.recipe import Plan, TensorSpec
from mxrl.weights.buckets import Export
from mxrl.weights.check import check_config, check_record
from mxrl.weights.digest import checksum
from mxrl.weights.record import WeightRecord

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "mxrl-quantized"
# 3: checksums over each tensor's name and bytes (mxrl-checksum-v2); 2: over its bytes alone;
# 1: sha256 content hashes
CHECKPOINT_VERSION = 3
MANIFEST_NAME = "manifest.json"
PLAN_NAME = "plan.json"
DEFAULT_SHARD_BYTES = 2 * 10**9
_HASH_CHUNK = 1 << 24


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
    check: Callable[[], None] | None = None,
) -> Path:
    """Write the records of one export (every tensor of `plan`, in any order) as a quantized
    checkpoint in `out_dir` (module docstring); return its path.

    records: WeightRecords, or an `Export` (its QuantizationEvent then goes into the manifest).
    config: the HF config dict (written as config.json). shard_bytes: bytes or "2GB"/"500MiB".
    overwrite: replace an existing non-empty directory once the new one is complete.
    copy_files_from: an HF directory whose tokenizer / generation files are copied.
    progress: tqdm bar (None: when stderr is a terminal). Raises ValueError for records that do
    not match the plan (unknown, duplicated, missing tensors; fields that are not what the plan
    stores; checksum mismatch).
    """
    out = Path(out_dir)
    limit = parse_size(shard_bytes)
    with staged(out, overwrite=overwrite, flag="overwrite=True (--overwrite)") as tmp:
        stream = records.records() if isinstance(records, Export) else iter(records)
        tensors, shards = _write_shards(tmp, stream, plan, limit, progress)
        check_complete(plan, tensors)
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
        if check is not None:
            check()  # the caller's last word (e.g. the engine's digest) before it is in place
    logger.info("wrote %d tensors in %d shard(s) to %s", len(tensors), len(shards), out)
    return out


def _manifest_text(manifest: dict[str, Any]) -> str:
    """Indented JSON with one line per tensor (a 30B model's manifest stays readable)."""
    head = {k: v for k, v in manifest.items() if k != "tensors"}
    lines = [f"    {json.dumps(n)}: {json.dumps(t)}" for n, t in manifest["tensors"].items()]
    body = json.dumps(head, indent=2)[:-2]
    return body + ',\n  "tensors": {\n' + ",\n".join(lines) + "\n  }\n}\n"


def checked_record(record: WeightRecord, plan: Plan, written: Container[str]) -> TensorSpec:
    """The plan's spec of a record about to be written, once it is checked: a tensor of the plan,
    not among those `written` already, its fields what the spec stores, its checksum its bytes'."""
    spec = plan.get(record.name)
    if spec is None:
        raise ValueError(f"{record.name!r} is not a tensor of the plan")
    if record.name in written:
        raise ValueError(f"{record.name} appears twice in the records")
    check_record(record, spec)
    if checksum(record.name, record.value) != record.hash:
        raise ValueError(f"{record.name}: checksum mismatch; re-export it")
    return spec


def check_complete(plan: Plan, written: Iterable[str]) -> None:
    """Refuse an export that lacks tensors of its plan (before its folder is in place)."""
    missing = [n for n in plan if n not in set(written)]
    if missing:
        raise ValueError(
            f"the records lack {len(missing)} tensor(s) of the plan, e.g. {missing[:3]}; "
            "export every tensor of the plan"
        )


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
            spec = checked_record(record, plan, tensors)
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


# --- reading --------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_quantized_checkpoint(
    path: str | Path,
) -> tuple[Plan, dict[str, Any], Iterator[WeightRecord]]:
    """(plan, HF config dict, records) of a quantized checkpoint directory.

    The manifest, plan and config are read and cross-checked now, and every shard's presence and
    size; each shard's sha256 is checked as the records reach it, before its tensors are used.
    Raises ValueError naming the file (and the tensor when the file still parses).
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"{str(path)!r} is not a directory (a quantized checkpoint from mxrl convert)"
        )
    manifest = _read_json(path / MANIFEST_NAME)
    if manifest.get("format") != CHECKPOINT_FORMAT or manifest.get("version") != CHECKPOINT_VERSION:
        raise ValueError(
            f"{path / MANIFEST_NAME} is not a {CHECKPOINT_FORMAT} v{CHECKPOINT_VERSION} manifest "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r}); older "
            "checkpoints carry checksums this version does not compute (v1: sha256 content "
            "hashes, v2: checksums without the tensor's name): re-run mxrl convert"
        )
    try:
        plan = Plan.from_json((path / PLAN_NAME).read_text())
    except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        # AttributeError: JSON that is not an object (a list, a number) has no fields to read
        raise ValueError(f"cannot read {path / PLAN_NAME}: {e!r}") from None
    except ValueError as e:
        raise ValueError(f"{path / PLAN_NAME}: {e}") from None
    if plan.hash() != manifest["plan_hash"]:
        raise ValueError(
            f"{path / PLAN_NAME} hashes to {plan.hash()[:16]}, {MANIFEST_NAME} says "
            f"{manifest['plan_hash'][:16]}: the files come from different conversions"
        )
    config = _read_json(path / CONFIG_NAME)
    check_config(path / CONFIG_NAME, config, plan)
    tensors: dict[str, dict[str, Any]] = manifest["tensors"]
    if set(tensors) != set(plan):
        odd = sorted(set(tensors) ^ set(plan))
        raise ValueError(f"{MANIFEST_NAME} and {PLAN_NAME} list different tensors: {odd[:3]}")
    for name, info in manifest["shards"].items():
        file = path / name
        if Path(name).name != name or not file.is_file():
            raise ValueError(f"shard {file} is missing; copy the whole checkpoint again")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise ValueError(
                f"shard {file} has {size} bytes, the manifest says {info['bytes']}: the file is "
                "truncated or corrupt; copy it again or re-run mxrl convert"
            )
    return plan, config, _records(path, manifest, plan)


def _records(path: Path, manifest: dict[str, Any], plan: Plan) -> Iterator[WeightRecord]:
    by_shard: dict[str, list[str]] = {}
    for name, info in manifest["tensors"].items():
        by_shard.setdefault(info["shard"], []).append(name)
    for shard, names in by_shard.items():
        file = path / shard
        expected = manifest["shards"][shard]["sha256"]
        if sha256_file(file) != expected:
            raise ValueError(_corruption_report(file, names, manifest["tensors"]))
        with open_safetensors(file) as f:
            for name in names:
                info = manifest["tensors"][name]
                record = WeightRecord(name, _value(f, name, info, file), info["hash"])
                try:
                    check_record(record, plan[name])
                except ValueError as e:
                    raise ValueError(f"{file}: {e}") from None
                yield record


def _value(f: Any, name: str, info: dict[str, Any], file: Path) -> QTensor | torch.Tensor:
    try:
        state = {k: f.get_tensor(k) for k in info["keys"]}
    except SafetensorError as e:
        raise ValueError(f"{file}: cannot read {name} ({e})") from None
    if info["format"] == Format.BF16:
        return state[name]
    try:
        return QTensor.from_state_dict(state, name)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{file}: {name} is not a QTensor ({e})") from None


def _corruption_report(file: Path, names: list[str], tensors: dict[str, dict[str, Any]]) -> str:
    """Name the tensors whose bytes changed, when the shard still parses."""
    bad: list[str] = []
    try:
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                value = _value(f, name, tensors[name], file)
                if checksum(name, value) != tensors[name]["hash"]:
                    bad.append(name)
    except (SafetensorError, ValueError, KeyError, TypeError, RuntimeError):
        bad = []
    where = f": tensor(s) {', '.join(bad[:5])} differ from their manifest checksum" if bad else ""
    return (
        f"shard {file} does not match its sha256 in {MANIFEST_NAME}{where}. The file is corrupt; "
        "copy it again or re-run mxrl convert"
    )


def _read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{file} is missing: not a quantized checkpoint from mxrl convert"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
