"""How far mxrl's block FP8 bytes are from an FP8 checkpoint's own (HF fine-grained FP8).

A model loaded from such a checkpoint holds the dequantized values w = fl(q * s) per 128x128
block (`mxrl.models.hf_fp8`). Quantizing them again under a recipe that makes the tensor
fp8_block in 128x128 blocks (the `fp8-block` preset) gives the file's bytes back for a block
exactly when its scale comes back:

    fl(max(fl(M * s), 1e-4) / 448) == s        (fp32 arithmetic, bit for bit)

M the block's largest |E4M3 value| in the file, s its scale; the codes then always come back
(q * s * fl(1/s) is within 3 fp32 roundings of q, far inside half an E4M3 step). In practice:
M = 448 (the file's scale is amax/448, as DeepSeek-V3 / transformers quantize), 448 * s is not
under the 1e-4 floor, and fl(fl(448 * s) / 448) == s, which holds for about 89.3% of fp32
significands; power-of-two (ue8m0) scales leave M anywhere in (224, 448], so such blocks differ
unless M = 448. `compare_with_source` counts it tensor by tensor, block by block, with the
reason of every block that differs (docs/checkpoints.md, "In: HF fine-grained FP8").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mxrl.arch.experts import Target, target_of
from mxrl.arch.hf import load_hf_config
from mxrl.formats.constants import E4M3_MAX, FP8_BLOCK_AMAX_FLOOR, Format
from mxrl.models import hf_fp8
from mxrl.models.hf_checkpoint import CONFIG_NAME, checkpoint_files, open_safetensors
from mxrl.recipe import Plan
from mxrl.weights.export import quantize_tensor

BLOCK = hf_fp8.BLOCK
# why a block differs, in the order a block is classified (the first that applies)
REASONS = {
    "split": "expert tensor off the 128-row grid of its fused gate_up parameter",
    "zero": "all-zero block (its scale is arbitrary; the values agree)",
    "codes": "codes differ under the same scale",
    "pow2": "max |code| < 448 with a power-of-two scale (ue8m0)",
    "not_amax": "max |code| < 448 (scale is not amax/448)",
    "floor": "448*s under the 1e-4 amax floor",
    "rounding": "fl(fl(448*s)/448) != s (the scale does not survive the round trip)",
    "other": "differs where the condition says it agrees (a bug: please report it)",
}


@dataclass
class Fp8SourceReport:
    """Agreement of the plan's block FP8 bytes with the checkpoint's, over the FP8 tensors the
    plan makes fp8_block in 128x128 blocks (`not_compared`: the other FP8 tensors of the file)."""

    tensors: int = 0
    tensors_equal: int = 0
    blocks: int = 0
    blocks_equal: int = 0
    code_bytes: int = 0
    code_bytes_equal: int = 0
    scales_equal: int = 0
    max_scale_rel_diff: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)  # REASONS key -> differing blocks
    not_compared: int = 0

    def fields(self) -> dict[str, Any]:
        """JSON-ready (the run record's `fp8_source` event)."""
        return asdict(self)

    def line(self) -> str:
        pct = 100.0 * self.blocks_equal / self.blocks if self.blocks else 100.0
        text = (
            f"fp8 source: {self.tensors_equal}/{self.tensors} FP8 tensors byte-identical to the "
            f"checkpoint's under the plan, {self.blocks_equal}/{self.blocks} blocks ({pct:.1f}%), "
            f"{self.code_bytes_equal}/{self.code_bytes} code bytes, "
            f"{self.scales_equal}/{self.blocks} scales; "
            f"largest relative scale difference {self.max_scale_rel_diff:.3g}"
        )
        if self.reasons:
            why = ", ".join(f"{n} {REASONS[k]}" for k, n in self.reasons.items())
            text += f"; differing blocks: {why}"
        if self.not_compared:
            text += (
                f"; {self.not_compared} FP8 tensor(s) not compared (the plan does not make "
                "them fp8_block 128x128)"
            )
        return text


def compare_with_source(
    model_dir: str | Path, plan: Plan, model: torch.nn.Module, *, backend: Any = None
) -> Fp8SourceReport | None:
    """Quantize the model's masters as the engine would (`quantize_tensor`, the export path)
    and compare with the FP8 tensors of checkpoint `model_dir` it was loaded from: codes as
    bytes, scales as fp32 bit patterns, per 128x128 block. None for a checkpoint without FP8.

    Cost: each fused parameter holding FP8 sources is quantized once; the file's FP8 tensors
    and scales are read again one at a time."""
    model_dir = Path(model_dir)
    if hf_fp8.fp8_config(load_hf_config(model_dir), model_dir / CONFIG_NAME) is None:
        return None
    sources: dict[str, list[tuple[Path, str, Target]]] = {}
    scale_files: dict[str, Path] = {}
    for file, _ in checkpoint_files(model_dir):
        with open_safetensors(file) as f:
            keys = list(f.keys())  # safe_open is not iterable
            for key in keys:
                if key.endswith(hf_fp8.SCALE_SUFFIX):
                    scale_files[key] = file
                elif f.get_slice(key).get_dtype() in hf_fp8.FP8_DTYPES:
                    target = target_of(key)
                    sources.setdefault(target.param, []).append((file, key, target))
    params = dict(model.named_parameters())
    report = Fp8SourceReport()
    for name, items in sources.items():
        spec = plan.get(name)
        if (
            spec is None
            or spec.format is not Format.FP8_BLOCK
            or tuple(spec.block or BLOCK) != BLOCK
        ):
            report.not_compared += len(items)
            continue
        mine = quantize_tensor(params[name], spec, backend=backend)
        codes, scales = mine.qdata.cpu(), mine.scale.cpu().to(torch.float32)
        for file, key, target in items:
            with open_safetensors(file) as f:
                q = f.get_tensor(key)
            skey = hf_fp8.scale_key(key)
            with open_safetensors(scale_files[skey]) as f:
                s = f.get_tensor(skey).to(torch.float32)
            split = target.part in ("gate", "up") and (codes.shape[-2] // 2) % BLOCK[0] != 0
            _compare(report, q, s, target.view(codes), None if split else target.view(scales))
    return report


def block_max(x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Per-128x128-block max of a [N, K] tensor (edge blocks zero-padded), [ceil(N/128),
    ceil(K/128)] = `grid`."""
    nr, nk = grid
    padded = torch.nn.functional.pad(
        x, (0, nk * BLOCK[1] - x.shape[1], 0, nr * BLOCK[0] - x.shape[0])
    )
    return padded.view(nr, BLOCK[0], nk, BLOCK[1]).amax(dim=(1, 3))


def reasons_of(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """Per block of a file's (E4M3 weight, fp32 scale): the index in REASONS of why re-quantizing
    its dequantized values under fp8_block 128x128 (fp32 scales) does not give it back, -1 where
    it does. From the file alone: the condition of the module docstring (m: the blocks' largest
    |E4M3 value|, computed here when not given)."""
    if m is None:
        m = block_max(q.to(torch.float32).abs(), tuple(s.shape))
    amax = torch.clamp(m * s, min=FP8_BLOCK_AMAX_FLOOR)  # fp32, as the quantizer
    back = amax / E4M3_MAX
    same = back.view(torch.int32) == s.view(torch.int32)
    mant, _ = torch.frexp(s)
    order = list(REASONS)
    out = torch.full(s.shape, -1, dtype=torch.int64)
    cases = [
        ("rounding", torch.ones_like(same)),
        ("floor", s * E4M3_MAX < FP8_BLOCK_AMAX_FLOOR),
        ("not_amax", m < E4M3_MAX),
        ("pow2", (m < E4M3_MAX) & (mant.abs() == 0.5)),
        ("zero", m == 0),
    ]
    for key, where in cases:  # later cases take precedence (REASONS order)
        out = torch.where(where & ~same, order.index(key), out)
    return out


def _compare(
    report: Fp8SourceReport,
    q: torch.Tensor,
    s: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor | None,
) -> None:
    """Add one file tensor (q, s) against mxrl's (codes, scales) (None: off the block grid)."""
    grid = tuple(s.shape)
    equal_bytes = q.view(torch.uint8) == codes
    codes_equal = block_max((~equal_bytes).to(torch.float32), grid) == 0
    m = block_max(q.to(torch.float32).abs(), grid)
    reason = reasons_of(q, s, m)
    if scales is None:
        scale_equal = torch.zeros(grid, dtype=torch.bool)
        reason = torch.full(grid, list(REASONS).index("split"))
    else:
        scale_equal = scales.view(torch.int32) == s.view(torch.int32)
        nonzero = (s != 0) & (m > 0)  # an all-zero block's scale is arbitrary
        if bool(nonzero.any()):
            rel = ((scales - s).abs()[nonzero] / s.abs()[nonzero]).max().item()
            report.max_scale_rel_diff = max(report.max_scale_rel_diff, rel)
        # the condition predicts the scale; codes differing under the same scale are a finding
        reason = torch.where(scale_equal & ~codes_equal, list(REASONS).index("codes"), reason)
        reason = torch.where(scale_equal & codes_equal, -1, reason)
        # a block whose bytes agree is equal whatever the condition says; one the condition
        # says agrees that differs anyway is "other" (tested never to happen)
        other = list(REASONS).index("other")
        reason = torch.where(~(scale_equal & codes_equal) & (reason < 0), other, reason)
    equal = scale_equal & codes_equal
    report.tensors += 1
    report.tensors_equal += bool(equal.all())
    report.blocks += equal.numel()
    report.blocks_equal += int(equal.sum())
    report.scales_equal += int(scale_equal.sum())
    report.code_bytes += q.numel()
    report.code_bytes_equal += int(equal_bytes.sum())
    keys = list(REASONS)
    for index, count in zip(*torch.unique(reason[~equal], return_counts=True), strict=True):
        k = keys[int(index)]
        report.reasons[k] = report.reasons.get(k, 0) + int(count)
