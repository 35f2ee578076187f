"""HF "fine-grained FP8" checkpoints (Qwen3-*-FP8 and the like): the config, the tensors, the
dequantization `from_pretrained` loads them with.

config.json holds `quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}` (optional `"scale_fmt":
"ue8m0"`, optional `"modules_to_not_convert"`). A quantized Linear stores `<module>.weight` in
float8_e4m3fn [N, K] and `<module>.weight_scale_inv` [ceil(N/128), ceil(K/128)] in float32
(or bfloat16, or float8_e8m0fnu), the dequantization multiplier of each 128x128 block:

    w[i, j] = fl(float32(q[i, j]) * float32(s[i // 128, j // 128]))      (in fp32)

an element of a partial edge block takes the scale of the block it falls in. The product is one
fp32 rounding (E4M3's 4 significant bits times the scale's 24 can need 28); with a power-of-two
scale (ue8m0) it is exact, in fp32 and in bf16. docs/checkpoints.md has the rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CONFIG_NAME = "config.json"
SCALE_SUFFIX = ".weight_scale_inv"
WEIGHT_SUFFIX = ".weight"
BLOCK = (128, 128)
# safetensors dtype names (the header's; no data is read to know them)
FP8_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
SCALE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F8_E8M0": "float8_e8m0fnu"}
Headers = dict[str, tuple[Path, tuple[int, ...], str]]  # key -> (file, shape, dtype)
Scales = dict[str, tuple[Path, str]]  # FP8 weight key -> (file, key) of its scale
FIX_FP8_CONFIG = (
    "config.json lacks the quantization_config of an FP8 release: restore the release's "
    "config.json, or re-save the checkpoint unquantized"
)
FIX_FP8 = (
    "each quantized weight (float8_e4m3fn [N, K]) needs its weight_scale_inv "
    "[ceil(N/128), ceil(K/128)] (float32, bfloat16 or float8_e8m0fnu) and the reverse; the "
    "checkpoint is incomplete or not HF fine-grained FP8: copy it again or re-save it"
)
_ACCEPTED = (
    'quant_method "fp8", fmt "e4m3", activation_scheme "dynamic", weight_block_size [128, 128], '
    'scale_fmt absent, "float" or "ue8m0"'
)


@dataclass(frozen=True)
class Fp8Config:
    """An accepted `quantization_config` (the block is always 128 x 128)."""

    scale_fmt: str = "float"  # "float" or "ue8m0" (power-of-two scales)
    modules_to_not_convert: tuple[str, ...] = ()
    block: tuple[int, int] = BLOCK


def fp8_config(hf_config: dict[str, Any], path: Path | str = CONFIG_NAME) -> Fp8Config | None:
    """The checkpoint's FP8 config (None: no `quantization_config`, a plain checkpoint).

    Raises ValueError naming `path` (config.json) and every field mxrl does not load: another
    quant_method ("compressed-tensors", "modelopt", "gptq", ...), fmt other than "e4m3",
    activation_scheme "static" (per-tensor activation scales mxrl would ignore), a
    weight_block_size other than [128, 128], a scale_fmt other than "float" / "ue8m0"."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    fix = (
        f"mxrl loads HF fine-grained FP8 checkpoints ({_ACCEPTED}) and unquantized ones; "
        "load the checkpoint's bf16 release instead, or dequantize it with its own tools first"
    )
    if not isinstance(qc, dict):
        raise ValueError(f"{path}: quantization_config must be an object, got {qc!r}. {fix}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{path}: quantization_config.quant_method is {method!r}; mxrl loads only "
            f'"fp8" (HF fine-grained FP8). {fix}'
        )
    bad = []
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        bad.append(f'fmt {fmt!r} (needs "e4m3")')
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        bad.append(
            f'activation_scheme {scheme!r} (needs "dynamic"; static activation scales are not used)'
        )
    block = qc.get("weight_block_size")
    if not isinstance(block, list | tuple) or [b for b in block] != list(BLOCK):
        bad.append(
            f"weight_block_size {block!r} (needs [128, 128]; per-tensor or other block sizes "
            "are not loaded)"
        )
    scale_fmt = qc.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        bad.append(f'scale_fmt {scale_fmt!r} (needs absent, "float" or "ue8m0")')
    skip = qc.get("modules_to_not_convert") or ()
    if not isinstance(skip, list | tuple) or not all(isinstance(m, str) for m in skip):
        bad.append(f"modules_to_not_convert {skip!r} (needs a list of module names)")
    if bad:
        raise ValueError(
            f"{path}: quantization_config has {len(bad)} unsupported field(s): "
            + "; ".join(bad)
            + f". {fix}"
        )
    return Fp8Config(scale_fmt=scale_fmt, modules_to_not_convert=tuple(skip))


def is_fp8_checkpoint(hf_config: dict[str, Any]) -> bool:
    """Whether config.json declares HF fine-grained FP8 (validated: raises for a bad one)."""
    return fp8_config(hf_config) is not None


def scale_key(weight_key: str) -> str:
    """`a.b.weight` -> `a.b.weight_scale_inv`."""
    return weight_key.removesuffix(WEIGHT_SUFFIX) + SCALE_SUFFIX


def weight_key(scale: str) -> str:
    """`a.b.weight_scale_inv` -> `a.b.weight`."""
    return scale.removesuffix(SCALE_SUFFIX) + WEIGHT_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """[ceil(N/128), ceil(K/128)] for a weight [N, K]."""
    return (math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    """fp32 w = fl(float32(q) * float32(s)) per block of a [N, K] E4M3 weight and its
    [ceil(N/br), ceil(K/bk)] scales (float32, bfloat16 or float8_e8m0fnu: converted exactly).
    Partial edge blocks are zero-padded for the product and cropped after, so each element
    takes the scale of the block it falls in. Transient memory: the fp32 result (+ padding)."""
    br, bk = block
    n, k = q.shape
    nr, nk = scale.shape
    values = q.to(torch.float32)  # exact (E4M3 fits fp32)
    pad_r, pad_k = nr * br - n, nk * bk - k
    if pad_r or pad_k:
        values = torch.nn.functional.pad(values, (0, pad_k, 0, pad_r))
    s = scale.to(torch.float32)  # exact from bf16 and e8m0
    out = (values.view(nr, br, nk, bk) * s[:, None, :, None]).view(nr * br, nk * bk)
    return out[:n, :k].contiguous() if pad_r or pad_k else out


def pow2(scale: torch.Tensor) -> bool:
    """Whether every scale is a power of two (ue8m0-style): then q * s is exact in bf16."""
    s = scale.to(torch.float32)
    mantissa, _ = torch.frexp(s)
    return bool(((mantissa.abs() == 0.5) | (s == 0)).all())


def sort_header(
    key: str, header: tuple[Path, tuple[int, ...], str], weights: Headers, scales: Headers
) -> bool:
    """File a header (file, shape, dtype) under FP8 weights or scales; True for a scale (the
    loader maps every other key to a parameter)."""
    if key.endswith(SCALE_SUFFIX):
        scales[key] = header
        return True
    if header[2] in FP8_DTYPES:
        weights[key] = header
    return False


def pair_headers(
    fp8: bool, weights: Headers, scales: Headers
) -> tuple[Scales, list[tuple[str, list[str], str]]]:
    """FP8 weight key -> (file, key) of its scale, and the problems of the pairs: (title, the
    tensors named with their file, the fix), listed by the loader with its other problems.
    fp8: config.json declares FP8 (else every FP8 tensor is a problem)."""
    if not fp8:
        stored = [f"{k} ({d} in {file.name})" for k, (file, _, d) in weights.items()]
        stored += [f"{k} (in {file.name})" for k, (file, _, _) in scales.items()]
        return {}, [("FP8 tensors without quantization_config", stored, FIX_FP8_CONFIG)]
    pairs: dict[str, tuple[Path, str]] = {}
    no_scale, dtypes, shapes = [], [], []
    for key, (file, shape, dtype) in weights.items():
        skey = scale_key(key)
        if dtype != "F8_E4M3":
            dtypes.append(f"{key} in {file.name}: {dtype}, expected F8_E4M3")
        if len(shape) != 2:
            dtypes.append(f"{key} in {file.name}: {len(shape)}-D, expected a 2-D [N, K] weight")
            continue
        entry = scales.get(skey)
        if entry is None:
            no_scale.append(f"{key} (in {file.name}, no {skey})")
            continue
        sfile, sshape, sdtype = entry
        want = scale_shape(shape)
        if sshape != want:
            shapes.append(
                f"{skey} in {sfile.name}: {list(sshape)}, expected {list(want)} for weight "
                f"{list(shape)} in 128x128 blocks"
            )
        if sdtype not in SCALE_DTYPES:
            dtypes.append(f"{skey} in {sfile.name}: {sdtype}, expected one of {list(SCALE_DTYPES)}")
        pairs[key] = (sfile, skey)
    orphans = [
        f"{skey} (in {file.name}, no FP8 {weight_key(skey)})"
        for skey, (file, _, _) in scales.items()
        if weight_key(skey) not in weights
    ]
    return pairs, [
        ("FP8 weights without their weight_scale_inv", no_scale, FIX_FP8),
        ("weight_scale_inv without an FP8 weight", orphans, FIX_FP8),
        ("FP8 scales of the wrong shape", shapes, FIX_FP8),
        ("FP8 tensors of an unsupported dtype or rank", dtypes, FIX_FP8),
    ]


def check_scale(scale: torch.Tensor, key: str, file: Path) -> None:
    """Refuse a NaN/Inf scale, naming it, its file and its first bad block."""
    s = scale.to(torch.float32)
    bad = ~torch.isfinite(s)
    if bool(bad.any()):
        first = int(bad.reshape(-1).to(torch.uint8).argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), s.shape))
        raise ValueError(
            f"cannot load {file.parent}: {key} in {file.name} holds {s[index].item()} at block "
            f"{index} ({int(bad.sum())} non-finite scale(s)); the FP8 checkpoint is damaged: "
            "copy it again, or pass check_finite=False to load it anyway"
        )
