"""Launch configurations of the low-bit decode GEMMs (`mxrl.kernels.decode_gemm`): `GemmConfig`,
and the tiles `choose_config` picks per shape, tuned on the H200 (docs/kernels.md has the table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxrl.formats import QTensor
from mxrl.kernels.backend import num_sms

DOT_MODES = ("bf16", "ieee", "fma")
NVFP4_DECODES = ("asm", "triton")
# programs per SM that split-K aims for, by path / block_m (H200 sweep, docs/kernels.md)
SPLIT_TARGET = {"fma": 3.6, "nvfp4-16": 1.4, 16: 3.6, 32: 1.8, 64: 0.9, 128: 0.9}


@dataclass(frozen=True)
class GemmConfig:
    """Launch configuration of the Triton GEMM (`choose_config` picks one per shape).

    block_m/n/k: tile sizes (powers of two; block_n >= 16; block_k >= 32; block_m >= 16 on
      the tensor cores, >= 1 with dot "fma").
    split_k: programs sharing one output tile along K (partials reduced in a fixed order).
    dot: "bf16" (tensor cores: MXFP8 operands as bf16, NVFP4 as fp16, exact in both), "fma"
      (CUDA cores: fp32 products summed per output; for a few rows, where a tensor-core tile
      would pad M to 16) or "ieee" (tl.dot in fp32 with IEEE adds; slow, for checks).
    nvfp4_decode: "asm" (inline PTX, 4 bytes per call: the fast path) or "triton" (the same
      values from Triton ops, one byte at a time); GPU only, the interpreter runs "triton".
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    dot: str = "bf16"
    nvfp4_decode: str = "asm"

    def __post_init__(self) -> None:
        low_m = 1 if self.dot == "fma" else 16
        for name, low in (("block_m", low_m), ("block_n", 16), ("block_k", 32), ("num_warps", 1)):
            v = getattr(self, name)
            if v < low or v & (v - 1):
                raise ValueError(f"GemmConfig.{name}={v}: must be a power of two >= {low}")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"GemmConfig: split_k and num_stages must be >= 1, got {self}")
        if self.dot not in DOT_MODES:
            raise ValueError(f"GemmConfig.dot={self.dot!r}: choose one of {DOT_MODES}")
        if self.nvfp4_decode not in NVFP4_DECODES:
            raise ValueError(
                f"GemmConfig.nvfp4_decode={self.nvfp4_decode!r}: choose one of {NVFP4_DECODES}"
            )

    @classmethod
    def ieee(cls, block_m: int = 16, split_k: int = 1) -> GemmConfig:
        """The fp32 FMA dot (IEEE products and adds; the checking path, slow) with tiles small
        enough for its registers."""
        return cls(block_m, 32, 32, split_k, 4 if block_m <= 64 else 8, 1, "ieee")


def choose_config(
    rows_per_group: int, num_groups: int, n: int, k: int, num_sms: int, fmt: str = "nvfp4"
) -> GemmConfig:
    """Tiles for `num_groups` groups (experts; 1 dense) of about `rows_per_group` rows each,
    tuned on the H200 with `benchmarks/decode_gemm.py --sweep` (docs/kernels.md has the table).

    - 1 or 2 rows (decode): the CUDA-core dot (block_m = the rows, block_n 32, block_k 256): a
      tensor-core tile would pad M to 16 and stage every decoded weight through shared memory.
    - NVFP4, 3..16 rows: tensor cores, block_m 16, block_k 256 (fewer, longer programs).
    - otherwise one tensor-core M tile covers the batch (block_m = next power of two of the
      rows, 16..128), block_n 64, block_k 128, so the weights are read once per launch.
    Split-K then multiplies the programs until about SPLIT_TARGET[path] per SM (latency
    hiding), never below one block_k per split. fmt: "nvfp4" or "mxfp8"."""
    rows = max(rows_per_group, 1)
    if rows <= 2:
        block_m, block_n, block_k = rows, 32, 256 if k >= 512 else 128
        cfg = dict(dot="fma", num_warps=4, num_stages=3)
        per_sm = SPLIT_TARGET["fma"]
    elif fmt == "nvfp4" and rows <= 16:
        block_m, block_n, block_k = 16, 64, 256 if k >= 512 else 128
        cfg = dict(num_warps=4, num_stages=3)
        per_sm = SPLIT_TARGET["nvfp4-16"]
    else:
        block_m = min(128, max(16, _next_pow2(rows)))
        block_n, block_k = 64, 128
        small = block_m <= 32
        cfg = dict(num_warps=4, num_stages=3) if small else dict(num_warps=8, num_stages=2)
        per_sm = SPLIT_TARGET[block_m]
    m_tiles = -(-rows // block_m)
    programs = -(-n // block_n) * max(num_groups, 1) * m_tiles
    target = int(per_sm * num_sms)
    split = 1
    while programs * split < target and split < 16 and 2 * split * block_k <= k:
        split *= 2
    return GemmConfig(block_m, block_n, block_k, split, **cfg)


def default_config(
    t: int, wq: QTensor, device: torch.device, active_experts: int | None = None
) -> GemmConfig:
    """The config the GEMMs use for T activation rows and the weight wq ([N, K], or [E, N, K]
    grouped: min(E, T) expert slots, of which `active_experts` (default all) expected busy)."""
    n, k, fmt = wq.shape[-2], wq.shape[-1], wq.fmt.value
    if len(wq.shape) == 2:
        return choose_config(t, 1, n, k, num_sms(device), fmt)
    slots = max(1, min(wq.shape[0], t))
    groups = min(slots, active_experts) if active_experts else slots
    return choose_config(-(-t // groups), groups, n, k, num_sms(device), fmt)


def _next_pow2(v: int) -> int:
    return 1 << max(0, (max(v, 1) - 1).bit_length())
