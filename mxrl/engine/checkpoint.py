"""Reading quantized checkpoints (written by `mxrl.sync.write_quantized_checkpoint`, i.e.
`mxrl convert`): the engine's side of the format, so `Engine.from_checkpoint` needs nothing to
its right. mxrl/sync/checkpoint.py documents the directory layout and writes it.

`read_quantized_checkpoint` checks file sizes up front and each shard's sha256 before using its
tensors, and yields records carrying the manifest's content hashes, which `Engine.load_weights`
recomputes; an error names the file and, when the file still parses, the tensor.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from mxrl.engine.weights import WeightRecord, content_hash
from mxrl.formats import QTensor
from mxrl.formats.constants import Format
from mxrl.models.checkpoint import open_safetensors
from mxrl.recipe import Plan

CHECKPOINT_FORMAT = "mxrl-quantized"
CHECKPOINT_VERSION = 1
MANIFEST_NAME = "manifest.json"
PLAN_NAME = "plan.json"
CONFIG_NAME = "config.json"
_HASH_CHUNK = 1 << 24


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
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})"
        )
    try:
        plan = Plan.from_json((path / PLAN_NAME).read_text())
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path / PLAN_NAME}: {e!r}") from None
    except ValueError as e:
        raise ValueError(f"{path / PLAN_NAME}: {e}") from None
    if plan.hash() != manifest["plan_hash"]:
        raise ValueError(
            f"{path / PLAN_NAME} hashes to {plan.hash()[:16]}, {MANIFEST_NAME} says "
            f"{manifest['plan_hash'][:16]}: the files come from different conversions"
        )
    config = _read_json(path / CONFIG_NAME)
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
    return plan, config, _records(path, manifest)


def _records(path: Path, manifest: dict[str, Any]) -> Iterator[WeightRecord]:
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
                yield WeightRecord(name, _value(f, name, info, file), info["hash"])


def _value(f: Any, name: str, info: dict[str, Any], file: Path) -> QTensor | torch.Tensor:
    try:
        state = {k: f.get_tensor(k) for k in info["keys"]}
    except SafetensorError as e:
        raise ValueError(f"{file}: cannot read {name} ({e})") from None
    if info["format"] == Format.BF16:
        return state[name]
    return QTensor.from_state_dict(state, name)


def _corruption_report(file: Path, names: list[str], tensors: dict[str, dict[str, Any]]) -> str:
    """Name the tensors whose bytes changed, when the shard still parses."""
    bad: list[str] = []
    try:
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                value = _value(f, name, tensors[name], file)
                if content_hash(value) != tensors[name]["hash"]:
                    bad.append(name)
    except (SafetensorError, ValueError, KeyError, TypeError, RuntimeError):
        bad = []
    where = f": tensor(s) {', '.join(bad[:5])} differ from their manifest hash" if bad else ""
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
