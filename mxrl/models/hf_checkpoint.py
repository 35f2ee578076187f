"""Local HF checkpoints: `from_pretrained` (safetensors, sharded or not); `mxrl.models.hf_save`
writes them (`save_pretrained`).

A checkpoint directory holds `config.json` and either one `model.safetensors` or shards
`model-0000i-of-0000n.safetensors` listed by `model.safetensors.index.json`. Routed experts may
be stored per expert or fused (`mxrl.arch.experts`); loading takes both, saving writes either.

Loading checks every header before reading any data (unknown, missing, duplicated keys, wrong
shapes), then copies tensor by tensor into the parameters of a model allocated once on the target
device, so at most one checkpoint tensor is in memory beside the model. Each tensor is checked
for NaN/Inf as it is copied (one min/max pass over what was loaded, no copy), and the first one
holding any stops the load, named by its key in the file (`check_finite=False` skips it).

HF fine-grained FP8 checkpoints (config.json `quantization_config`, `mxrl.models.hf_fp8`) load
as their dequantized values: each E4M3 weight is multiplied by its `weight_scale_inv` per
128x128 block in fp32, then cast to the requested dtype; the pairs, the scales' shapes and the
config are checked with the headers, and the NaN/Inf check reads the dequantized values.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from mxrl.arch.config import ModelConfig
from mxrl.arch.experts import Target, target_of, units_of
from mxrl.arch.hf import load_hf_config
from mxrl.models import hf_fp8
from mxrl.models.model import CausalLM, empty_model

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_FIX_UNKNOWN = (
    "config.json does not describe this checkpoint (model_type, num_experts, mlp_only_layers, "
    "tie_word_embeddings, qkv bias?), or the names are not the canonical HF ones"
)
_FIX_MISSING = (
    "the checkpoint is incomplete, or config.json describes a bigger model; fix config.json or "
    "re-save the checkpoint"
)
_FIX_SHAPE = (
    "config.json does not match the weights (hidden_size, head_dim, num_key_value_heads, "
    "intermediate sizes?)"
)
_FIX_INDEX = f"re-save the checkpoint ({INDEX_NAME} must list exactly the tensors of each shard)"
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
_ALL = (-1, "all")  # coverage unit of a tensor that fills its whole parameter
_SHOW = 5  # names listed per problem in an error


def from_pretrained(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    check_finite: bool = True,
    progress: bool | None = None,
) -> CausalLM:
    """Load a local HF checkpoint directory into a `CausalLM` in `dtype` on `device` (eval mode).

    check_finite: refuse a tensor holding NaN/Inf, or a value that overflows to Inf in `dtype`
      (False loads it anyway, e.g. to inspect a diverged run's checkpoint).
    progress: show a tqdm bar (None: only when stderr is a terminal).
    An HF fine-grained FP8 checkpoint loads as fl(q * s) per 128x128 block, computed in fp32
    and cast to `dtype` (`mxrl.models.hf_fp8`; one warning when `dtype` rounds those values).
    Raises ValueError naming the file or tensors for a bad config (an unsupported
    `quantization_config` included), corrupt file, unknown, missing or duplicated tensors, wrong
    shapes, an FP8 weight and its scale that do not pair up; and naming the file, the key as
    stored in it, the index and the value for the first non-finite value (or scale).
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"{str(path)!r} is not a directory; from_pretrained takes a local HF model directory "
            f"({CONFIG_NAME} + {WEIGHTS_NAME} or sharded *.safetensors with {INDEX_NAME})"
        )
    config = ModelConfig.from_hf(path)
    fp8 = hf_fp8.fp8_config(load_hf_config(path), path / CONFIG_NAME)
    files = checkpoint_files(path)
    model = empty_model(config, dtype=dtype, device=device)
    params = dict(model.named_parameters())
    plan, tied_head, scales = _plan(
        path,
        files,
        params,
        tied=config.tie_word_embeddings,
        fp8=fp8 is not None,
        unbuilt=_unbuilt_layers(config),
    )
    total = sum(len(items) for items in plan.values())
    rounded = 0  # fp8 tensors whose dequantized values `dtype` rounds
    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=total, unit="tensor", desc="loading", disable=not show) as bar, torch.no_grad():
        for file, items in plan.items():
            bar.set_postfix_str(file.name)
            with open_safetensors(file) as f:
                for key, target in items:
                    stored = f.get_tensor(key)
                    if key in scales:
                        scale = _read_scale(f, file, *scales[key], check_finite=check_finite)
                        stored = hf_fp8.dequantize(stored, scale)
                        rounded += dtype != torch.float32 and not hf_fp8.pow2(scale)
                    loaded = target.view(params[target.param])
                    loaded.copy_(stored)
                    if check_finite:
                        _check_finite(file, key, stored, loaded)
                    bar.update()
        if tied_head is not None:
            _check_tied_head(tied_head, params["model.embed_tokens.weight"])
    if rounded:
        logger.warning(
            "%s: %d of %d FP8 weights have scales that are not powers of two: their dequantized "
            "values q * s are rounded to %s (load in torch.float32 to keep them as stored)",
            path, rounded, len(scales), dtype,
        )  # fmt: skip
    logger.info("loaded %d tensors from %d file(s) of %s as %s", total, len(plan), path, dtype)
    return model.eval()


def checkpoint_files(path: Path) -> list[tuple[Path, set[str] | None]]:
    """The safetensors files of a checkpoint, each with the keys the index assigns to it (None
    for a single unindexed file)."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{index} is not a safetensors index ({e!r}); it needs a 'weight_map' object "
                "of tensor name -> shard file. Re-save the checkpoint."
            ) from None
        by_file: dict[str, set[str]] = {}
        for key, name in weight_map.items():
            by_file.setdefault(name, set()).add(key)
        for name in by_file:
            if Path(name).name != name or not (path / name).is_file():
                raise ValueError(
                    f"{index} lists shard {name!r}, which is not a file in {path}; the checkpoint "
                    "is incomplete: copy the missing shard or re-save the checkpoint"
                )
        return [(path / name, keys) for name, keys in sorted(by_file.items())]
    if (path / WEIGHTS_NAME).is_file():
        return [(path / WEIGHTS_NAME, None)]
    others = sorted(p.name for p in path.glob("*.safetensors")) + sorted(
        p.name for p in path.glob("*.bin")
    )
    hint = (
        f" (found {others[:3]}: shards need {INDEX_NAME}; .bin files must be converted to "
        "safetensors)"
        if others
        else ""
    )
    raise ValueError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path}{hint}")


@contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """safe_open that turns a corrupt or truncated file into a ValueError naming it."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(
            f"cannot read safetensors file {file}: {e}. The file is corrupt or truncated; "
            "copy it again or re-save the checkpoint"
        ) from None


def _plan(
    path: Path,
    files: list[tuple[Path, set[str] | None]],
    params: dict[str, torch.Tensor],
    *,
    tied: bool,
    fp8: bool = False,
    unbuilt: frozenset[int] = frozenset(),
) -> tuple[dict[Path, list[tuple[str, Target]]], tuple[Path, str] | None, hf_fp8.Scales]:
    """Read every header; return (file -> [(key, target)], the tied lm_head to check, FP8
    weight key -> (file, key) of its scale) or raise. fp8: config.json declares FP8. unbuilt:
    layer indices whose tensors are skipped (`Family.unbuilt_layers`)."""
    plan: dict[Path, list[tuple[str, Target]]] = {}
    covered: dict[str, set[tuple[int, str]]] = {}
    seen: dict[str, Path] = {}
    unknown: list[str] = []
    shapes: list[str] = []
    dups: list[str] = []
    index_gaps: list[str] = []
    tied_head: tuple[Path, str] | None = None
    fp8_weights: hf_fp8.Headers = {}
    scale_entries: hf_fp8.Headers = {}
    for file, index_keys in files:
        with open_safetensors(file) as f:
            keys = list(f.keys())
            if index_keys is not None and set(keys) != index_keys:
                gaps = sorted(index_keys ^ set(keys))
                index_gaps += [
                    f"{k} ({'not in' if k in index_keys else 'unlisted in'} {file.name})"
                    for k in gaps
                ]
            items = plan.setdefault(file, [])
            keys = _built_keys(keys, unbuilt, file)
            for key in keys:
                if key in seen:
                    dups.append(f"{key} (in {seen[key].name} and {file.name})")
                    continue
                seen[key] = file
                sliced = f.get_slice(key)
                shape, stored_dtype = tuple(sliced.get_shape()), sliced.get_dtype()
                header = (file, shape, stored_dtype)
                if hf_fp8.sort_header(key, header, fp8_weights, scale_entries):
                    continue  # a scale, paired with its weight by _pair_fp8
                if tied and key == "lm_head.weight":
                    # Tied checkpoints may repeat the embedding as lm_head; checked after loading.
                    want = tuple(params["model.embed_tokens.weight"].shape)
                    if shape != want:
                        shapes.append(f"{key}: {list(shape)}, expected {list(want)}")
                    tied_head = (file, key)
                    continue
                target = target_of(key)
                param = params.get(target.param)
                if param is None or (target.expert is not None and target.expert >= len(param)):
                    unknown.append(key)
                    continue
                want = tuple(target.view(param).shape)
                if shape != want:
                    shapes.append(f"{key}: {list(shape)}, expected {list(want)}")
                    continue
                cov = covered.setdefault(target.param, set())
                unit = target.unit or _ALL
                if _ALL in cov or unit in cov or (unit == _ALL and cov):
                    dups.append(f"{key} (overlaps tensors already read for {target.param})")
                    continue
                cov.add(unit)
                items.append((key, target))
    missing = [_missing(name, p, covered.get(name, set())) for name, p in params.items()]
    missing = [m for m in missing if m]
    scales, fp8_problems = hf_fp8.pair_headers(fp8, fp8_weights, scale_entries)
    _refuse(path, fp8_problems, unknown, missing, shapes, dups, index_gaps)
    return plan, tied_head, scales


def _refuse(path: Path, fp8_problems, unknown, missing, shapes, dups, index_gaps) -> None:
    """One ValueError listing every problem `_plan` found, if any."""
    problems = [
        *(_list(*problem) for problem in fp8_problems),
        _list("unknown tensors", unknown, _FIX_UNKNOWN),
        _list("tensors missing", missing, _FIX_MISSING),
        _list("tensors with the wrong shape", shapes, _FIX_SHAPE),
        _list("duplicated tensors", dups, "keep each tensor once: one expert layout, one shard"),
        _list("index/shard disagreements", index_gaps, _FIX_INDEX),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(f"cannot load {path}:\n" + "\n".join(problems))


def _unbuilt_layers(config: ModelConfig) -> frozenset[int]:
    from mxrl.arch import family

    count = family(config.model_type).unbuilt_layers
    first = config.num_hidden_layers
    return frozenset(range(first, first + count(config.hf_config))) if count else frozenset()


def _built_keys(keys: list[str], unbuilt: frozenset[int], file: Path) -> list[str]:
    """`keys` without those of the `unbuilt` layers (logged)."""
    built = [k for k in keys if (m := _LAYER_RE.match(k)) is None or int(m[1]) not in unbuilt]
    if len(built) < len(keys):
        logger.info("%s: skipped %d tensors of layers %s, which mxrl.models does not build "
                    "(multi-token prediction)", file, len(keys) - len(built), sorted(unbuilt))  # fmt: skip
    return built


def _read_scale(
    f: Any, file: Path, scale_file: Path, key: str, *, check_finite: bool
) -> torch.Tensor:
    """The scale tensor `key` (from the open `file` or from its own shard), checked finite."""
    if scale_file == file:
        scale = f.get_tensor(key)
    else:
        with open_safetensors(scale_file) as other:
            scale = other.get_tensor(key)
    if check_finite:
        hf_fp8.check_scale(scale, key, scale_file)
    return scale


def _missing(name: str, param: torch.Tensor, cov: set[tuple[int, str]]) -> str:
    if _ALL in cov:
        return ""
    units = units_of(name, param)
    if not units or not cov:
        return name
    lacking = sorted({e for e, _ in units - cov})
    if not lacking:
        return ""
    return f"{name} (experts {_short([str(e) for e in lacking])} incomplete)"


def _short(items: list[str]) -> str:
    head = ", ".join(items[:_SHOW])
    return head + (f" and {len(items) - _SHOW} more" if len(items) > _SHOW else "")


def _list(title: str, items: list[str], fix: str) -> str:
    return f"  - {len(items)} {title}: {_short(items)}. Fix: {fix}." if items else ""


def _check_finite(file: Path, key: str, stored: torch.Tensor, loaded: torch.Tensor) -> None:
    """Raise ValueError if `loaded` (the parameter slice `stored` was copied into: same shape,
    so same indices) holds NaN/Inf. The common case is one fused min/max pass (NaN propagates
    through both, Inf shows in one); only a failing tensor is searched for its first index."""
    if not loaded.is_floating_point() or loaded.numel() == 0:
        return
    lo, hi = torch.aminmax(loaded)
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return
    bad = ~torch.isfinite(loaded)
    num_bad = int(bad.sum())
    first = int(bad.reshape(-1).to(torch.uint8).argmax())  # argmax: the first maximal value
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), loaded.shape))
    value = stored[index].item()
    what = f"{key} in {file.name} holds {value} at index {index}"
    if math.isfinite(value):  # finite in the file, out of range of the load dtype
        raise ValueError(
            f"cannot load {file.parent}: {what}, which overflows to {loaded[index].item()} in "
            f"{loaded.dtype} ({num_bad} non-finite value(s) in that tensor once cast). Load in "
            "a dtype with a wider range (torch.float32 or torch.bfloat16)."
        )
    raise ValueError(
        f"cannot load {file.parent}: {what} ({num_bad} non-finite value(s) in that tensor). "
        "The checkpoint holds NaN/Inf: it was saved from a diverged run or is damaged; load an "
        "earlier checkpoint, or pass check_finite=False to load it anyway (e.g. to inspect it)."
    )


def _check_tied_head(tied_head: tuple[Path, str], embed: torch.Tensor) -> None:
    file, key = tied_head
    with open_safetensors(file) as f:
        head = f.get_tensor(key)
    if not torch.equal(head.to(device=embed.device, dtype=embed.dtype), embed):
        raise ValueError(
            f"config.json sets tie_word_embeddings, but {key} in {file} differs from "
            "model.embed_tokens.weight; set tie_word_embeddings to false to load both"
        )
