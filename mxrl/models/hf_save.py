"""Writing local HF checkpoints: `save_pretrained` (one `model.safetensors` or shards listed by
`model.safetensors.index.json`, routed experts per expert or fused), written into a temporary
folder and moved into place whole; `parse_size`, `copy_side_files`, `staged` are shared
with the quantized checkpoint writer (`mxrl.weights.quantized_checkpoint`)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from mxrl.arch.experts import hf_tensors
from mxrl.arch.names import keeps_fp32
from mxrl.models.hf_checkpoint import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME
from mxrl.models.model import CausalLM

logger = logging.getLogger(__name__)

# Files that travel with the weights when `save_pretrained(copy_files_from=...)` is given.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


def save_pretrained(
    model: CausalLM,
    path: str | Path,
    expert_layout: str = "per_expert",
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    *,
    overwrite: bool = False,
    copy_files_from: str | Path | None = None,
    progress: bool | None = None,
) -> Path:
    """Write `model` as an HF checkpoint directory; return its path.

    expert_layout: "per_expert" (as published checkpoints) or "fused" (transformers >= 5 names).
    max_shard_size: bytes, or a string such as "5GB", "500MB", "2GiB"; one shard is written as
    `model.safetensors`, more as `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
    dtype: cast every tensor (None keeps each parameter's dtype). config.json records it.
    overwrite: replace an existing non-empty directory (only once the new one is complete).
    copy_files_from: a directory whose tokenizer / generation files (SIDE_FILES) are copied over.
    The checkpoint is written to a temporary sibling directory and renamed into place, so a
    failed save leaves `path` as it was.
    """
    path = Path(path)
    limit = parse_size(max_shard_size)
    state = model.state_dict()
    tensors = list(hf_tensors(state, expert_layout))
    first = next(t for _, t in tensors if t.is_floating_point())
    saved_dtype = str(dtype or first.dtype).removeprefix("torch.")
    with staged(path, overwrite=overwrite) as tmp:
        config = model.config.to_hf(dtype=saved_dtype)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_shards(tmp, tensors, limit, dtype, progress)
        if copy_files_from is not None:
            copy_side_files(copy_files_from, tmp)
    logger.info("saved %d tensors to %s (%s, %s)", len(tensors), path, expert_layout, saved_dtype)
    return path


def _write_shards(
    out: Path,
    tensors: list[tuple[str, torch.Tensor]],
    limit: int,
    dtype: torch.dtype | None,
    progress: bool | None,
) -> None:
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = total = 0
    for name, t in tensors:
        nbytes = t.numel() * _dtype(name, t, dtype).itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
        total += nbytes
    n = len(shards)
    names = (
        [WEIGHTS_NAME]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    show = sys.stderr.isatty() if progress is None else progress
    for fname, shard in tqdm(
        list(zip(names, shards, strict=True)), desc="saving", disable=not show
    ):
        # Fresh contiguous CPU copies: safetensors refuses views sharing storage (expert slices).
        data = {
            k: t.detach().to("cpu", _dtype(k, t, dtype), copy=True).contiguous() for k, t in shard
        }
        save_file(data, str(out / fname), metadata={"format": "pt"})
    if n > 1:
        weight_map = {k: f for f, shard in zip(names, shards, strict=True) for k, _ in shard}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _dtype(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The saved dtype: `dtype`, except for the fp32 tensors (DeepSeek's router bias)."""
    return t.dtype if dtype is None or keeps_fp32(name) else dtype


@contextmanager
def staged(path: str | Path, *, overwrite: bool, flag: str = "overwrite=True") -> Iterator[Path]:
    """A temporary sibling of `path` to write a checkpoint into; renamed to `path` when the block
    ends without error (with the permissions of any file this process creates: mkdtemp makes it
    0700 and safetensors its files 0600), removed when it raises. So a failed or refused write
    leaves nothing behind and changes nothing that was there; `path` must not exist or be an
    empty directory unless `overwrite` (`flag`: how the caller spells that option)."""
    path = Path(path)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())) and not overwrite:
        raise ValueError(
            f"{path} exists and is not an empty directory; pass {flag} to replace it, or write "
            "to a new directory"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        _default_permissions(tmp)
        move_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _default_permissions(tmp: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)


def move_into_place(tmp: Path, path: Path) -> None:
    """Rename a finished temporary directory to `path`, replacing any old one only once the
    new one is in place (the old one is restored if the rename fails)."""
    if not path.exists():
        tmp.rename(path)
        return
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    path.rename(old)
    try:
        tmp.rename(path)
    except BaseException:
        old.rename(path)
        raise
    shutil.rmtree(old)


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB" (10^9, as transformers) or "2GiB" (2^30)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if m is None or float(m.group(1)) <= 0 or m.group(2) not in _UNITS:
        raise ValueError(
            f"max_shard_size: {size!r} is not a positive byte count or size string such as "
            "'5GB', '500MB' or '2GiB'"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def copy_side_files(src: str | Path, dst: str | Path, names: Iterable[str] = SIDE_FILES) -> None:
    """Copy the tokenizer / generation files present in `src` to `dst`."""
    for name in names:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
