"""`mxrl convert`: an HF checkpoint -> a quantized checkpoint (mxrl's own, or a served one that
transformers / vLLM / SGLang load: `mxrl.weights.served`), through the one export path."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mxrl.arch import load_hf_config, tensors_from_hf_config
from mxrl.models import from_pretrained, parse_size
from mxrl.models.hf_fp8 import fp8_config
from mxrl.recipe import Plan, Recipe, resolve
from mxrl.weights.buckets import DEFAULT_BUCKET_BYTES, export
from mxrl.weights.digest import weights_digest
from mxrl.weights.fp8_source import Fp8SourceReport, compare_with_source
from mxrl.weights.quantized_checkpoint import (
    DEFAULT_SHARD_BYTES,
    MANIFEST_NAME,
    write_quantized_checkpoint,
)
from mxrl.weights.served import served_format, write_served_checkpoint

TARGETS = ("mxrl", "hf")  # mxrl's quantized checkpoint; a served HF checkpoint
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
    to: str = "mxrl",
    on_fp8_source: Callable[[Fp8SourceReport], None] | None = None,
) -> Path:
    """HF checkpoint -> quantized checkpoint (what `mxrl convert` runs); returns out_dir.

    The plan is resolved on config.json first and handed to `on_plan` (the CLI prints its
    summary), then checked (`Plan.check`: strict refuses a recipe that does not do what it
    says on this model), all before a byte is read or written.

    The weights are loaded in the checkpoint's own dtype (config.json `dtype` / `torch_dtype`;
    float32 when absent), which every quantizer reads exactly, so the bytes equal a live export
    of the same values. The plan is `recipe` resolved on the model's parameters.

    to: "mxrl" writes mxrl's quantized checkpoint (`Engine.from_checkpoint` reads it); "hf" a
    served checkpoint (`mxrl.weights.served`: HF fine-grained FP8 or compressed-tensors, the
    same codes and scales), refused before any weight is read if the plan has no served layout.

    An HF fine-grained FP8 checkpoint (config.json `quantization_config`) is loaded in float32
    whatever its `torch_dtype` says: its dequantized values q * s are fp32 values, which bf16
    would round. Its bytes are then compared with the ones the plan writes
    (`compare_with_source`), and the report handed to `on_fp8_source` (the CLI prints its line).
    """
    if to not in TARGETS:
        raise ValueError(f"--to {to!r} is not one of {TARGETS}")
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
    fp8 = fp8_config(config, model_dir / "config.json")  # refuses a quantization_config
    # Resolve on the config first: a bad recipe fails before gigabytes are read.
    first = resolve(recipe, tensors_from_hf_config(config, expert_layout="fused"))
    if on_plan is not None:
        on_plan(first)
    first.check(strict=strict)
    if to == "hf":
        served_format(first)  # a plan the served layouts cannot hold: refused before any read
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    if fp8 is not None:
        stored = "float32"  # the dequantized values exactly as the file defines them
    model = from_pretrained(model_dir, dtype=_LOAD_DTYPES.get(str(stored), torch.float32))
    plan = resolve(recipe, {n: p.shape for n, p in model.named_parameters()})
    if fp8 is not None:
        report = compare_with_source(model_dir, plan, model)
        if on_fp8_source is not None and report is not None:
            on_fp8_source(report)
    return export_checkpoint(
        model,
        plan,
        config,
        out_dir,
        shard_bytes=shard_bytes,
        overwrite=overwrite,
        progress=progress,
        to=to,
        copy_files_from=model_dir,
    ).path


@dataclass(frozen=True)
class Exported:
    """What `export_checkpoint` wrote: the folder and the checksum of every tensor in it (the
    engine's `hashes` for the same weights and plan: their `weights_digest`s agree exactly when
    the bytes do)."""

    path: Path
    hashes: dict[str, str]


def export_checkpoint(
    model: torch.nn.Module,
    plan: Plan,
    config: dict[str, Any],
    out_dir: str | Path,
    *,
    shard_bytes: int | str = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool | None = None,
    to: str = "mxrl",
    copy_files_from: str | Path | None = None,
    expect_digest: str | None = None,
) -> Exported:
    """Master weights in hand -> a quantized (`to="mxrl"`) or served (`to="hf"`) checkpoint,
    through the one export path; `config` is the HF config dict written beside them.

    expect_digest: the `weights_digest` the records must have (an engine's, for the same master
    and plan); checked once the last record is written and before the folder is moved into
    place, so a mismatch leaves nothing behind (ValueError)."""
    if to not in TARGETS:
        raise ValueError(f"--to {to!r} is not one of {TARGETS}")
    updates = export(model, plan, bucket_bytes=DEFAULT_BUCKET_BYTES)

    def check() -> None:
        got = weights_digest(updates.hashes.items())
        if expect_digest is not None and got != expect_digest:
            raise ValueError(
                f"the exported weights' digest {got[:16]} is not the engine's "
                f"{expect_digest[:16]}: these bytes are not the ones it rolled out with; nothing "
                "was written"
            )

    write = write_served_checkpoint if to == "hf" else write_quantized_checkpoint
    path = write(
        updates,
        plan,
        config,
        out_dir,
        shard_bytes,
        overwrite=overwrite,
        copy_files_from=copy_files_from,
        progress=progress,
        check=check,
    )
    return Exported(Path(path), dict(updates.hashes))


def summary_lines(out: Path) -> list[str]:
    """What `mxrl convert` prints about the checkpoint it wrote in `out` (either target)."""
    manifest_file = out / MANIFEST_NAME
    if not manifest_file.is_file():
        return _served_lines(out)
    manifest = json.loads(manifest_file.read_text())
    event = manifest["quantization_event"]
    lines = [f"recipe: {manifest['recipe']}, plan hash {manifest['plan_hash']}"]
    by_format: dict[str, list[int]] = {}
    for t in manifest["tensors"].values():
        count = by_format.setdefault(t["format"], [0, 0])
        count[0] += 1
        count[1] += t["bytes"]
    for fmt, (n, nbytes) in sorted(by_format.items()):
        lines.append(f"  {fmt:<10} {n:6d} tensors  {nbytes / 2**20:10.2f} MiB")
    lines.append(
        f"  total      {manifest['num_tensors']:6d} tensors  "
        f"{manifest['num_bytes'] / 2**20:10.2f} MiB in {len(manifest['shards'])} shard(s)"
    )
    if event["sqnr_db"]:
        sqnr = ", ".join(f"{k} {float(v):.1f}" for k, v in event["sqnr_db"].items())
        lines.append(f"SQNR (dB) of the quantized tensors: {sqnr}")
    lines.append(f"quantized in {event['seconds']:.2f} s; wrote {manifest_file}")
    return lines


def _served_lines(out: Path) -> list[str]:
    config = json.loads((out / "config.json").read_text())
    qc = config.get("quantization_config") or {"quant_method": "none (bf16)"}
    files = sorted(p.name for p in out.glob("*.safetensors"))
    size = sum((out / f).stat().st_size for f in files)
    groups = [g["format"] for g in (qc.get("config_groups") or {}).values()]
    skipped = qc.get("modules_to_not_convert", qc.get("ignore", []))
    return [
        f"recipe: {config['mxrl']['recipe']}, plan hash {config['mxrl']['plan_hash']}",
        f"quantization_config: {qc['quant_method']}"
        + (f" ({', '.join(groups)})" if groups else "")
        + f"; {len(skipped)} Linear module(s) kept bf16",
        f"{len(files)} shard(s), {size / 2**20:.2f} MiB",
    ]
