"""Every number the formats use, in one place (spec/formats.md §1-§5).

Bit patterns are given as integers so that the fp32 constants the kernels use can be rebuilt
exactly (`f32_from_bits`), never re-derived by a Python float division that might round
differently.
"""

from __future__ import annotations

import struct
from enum import StrEnum


class Format(StrEnum):
    """Storage formats a recipe can assign to a tensor."""

    BF16 = "bf16"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"
    FP8_BLOCK = "fp8_block"


QUANTIZED_FORMATS = (Format.MXFP8, Format.NVFP4, Format.FP8_BLOCK)


def f32_from_bits(bits: int) -> float:
    """The fp32 value with this bit pattern, as a Python float (exact)."""
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# --- FP8 E4M3 (float8_e4m3fn), spec §1.1 ---------------------------------------------------
E4M3_MAX = 448.0
E4M3_MAX_CODE = 0x7E
E4M3_NAN_CODE = 0x7F  # canonical NaN byte after satfinite (sign dropped), spec §1.5
# RNE rounds [448, 464] to 448 (464 is the tie with 480, whose mantissa is odd); above it only
# the saturation keeps a value at 448. An NVFP4 block scale past it has clipped its block.
E4M3_SATURATION_EDGE = 464.0
E4M3_EMAX = 8  # exponent of the largest power of two <= 448 (OCP FLOOR rule, spec §2.2)

# --- FP4 E2M1, spec §1.2 ---------------------------------------------------------------------
E2M1_MAX = 6.0
E2M1_EMAX = 2
# code (0..7) -> magnitude; codes 8..15 are the negatives (8 = -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round-to-nearest-even decision points on |x| (spec §1.5): (threshold, inclusive). |x| above a
# threshold (or equal to it, when inclusive) moves to the next code. Ties go to the even code.
E2M1_RNE_THRESHOLDS = (
    (0.25, False),  # 0.25 ties to 0 (code 0, even)
    (0.75, True),  # 0.75 ties to 1.0 (code 2, even)
    (1.25, False),  # 1.25 ties to 1.0
    (1.75, True),  # 1.75 ties to 2.0 (code 4)
    (2.5, False),  # 2.5 ties to 2.0
    (3.5, True),  # 3.5 ties to 4.0 (code 6)
    (5.0, False),  # 5.0 ties to 4.0
)

# --- E8M0 / UE8M0, spec §1.3 -----------------------------------------------------------------
E8M0_BIAS = 127
E8M0_MAX_CODE = 254  # 2^127; 255 is NaN
E8M0_NAN_CODE = 255
F32_MANTISSA_BITS = 23
F32_EXP_MASK = 0xFF
F32_MANTISSA_MASK = 0x7FFFFF
F32_HALF_SUBNORMAL = 0x400000  # the E == 0 rule of ceil_e8m0 (spec §2.2)
F32_2_POW_M127_BITS = 0x00400000  # 2^-127 as an fp32 subnormal

# --- finite in, finite out (docs/formats.md, "The top of the fp32 range") -----------------------
# A power-of-two scale 2^(c-127) whose 448 x scale overflows fp32 (c >= 247, i.e. 2^120 and up)
# caps its elements at the largest E4M3 value whose product with it is finite. Every finite
# input gets c <= 247 (MXFP8 RCEIL: ceil_e8m0(FLT_MAX * fl(1/448)) = 247; block FP8 ue8m0 the
# same), and at 2^120 that value is 240 (0x77): 256 * 2^120 = 2^128 is +Inf, 240 * 2^120 =
# 3.19e38. Below code 247 the cap is 448, which `e4m3_encode` saturates to anyway.
E8M0_OVERFLOW_CODE = 247  # smallest c with 448 * 2^(c-127) > FLT_MAX
E4M3_MAX_AT_OVERFLOW_CODE = 240.0  # largest E4M3 v with v * 2^120 <= FLT_MAX

# --- FP32 constants the kernels use (spec §2.2, §3.3) -----------------------------------------
FLT_MAX = f32_from_bits(0x7F7FFFFF)
RCP_448_BITS = 0x3B124925  # fl(1/448)
RCP_6_BITS = 0x3E2AAAAB  # fl(1/6)
RCP_448 = f32_from_bits(RCP_448_BITS)
RCP_6 = f32_from_bits(RCP_6_BITS)
RCP_4 = 0.25  # fl(1/4), exact: NVFP4 4over6's map-to-4 candidate (docs/formats.md)
NVFP4_GLOBAL_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688 = 448 * 6, exact in fp32

# --- blocks ----------------------------------------------------------------------------------
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
FP8_BLOCK_WEIGHT = (128, 128)  # DeepSeek-V3 weights
FP8_BLOCK_ACTIVATION = (1, 128)  # DeepSeek-V3 activations (per token, 128 along K)
FP8_BLOCK_AMAX_FLOOR = 1e-4  # DeepGEMM / DeepSeek-V3 clamp of the block amax (spec §5.1-5.2)

# --- scale layout for native GEMMs, spec §4.1 --------------------------------------------------
SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4

# Bits per stored weight, scales included (for reporting and roofline arithmetic).
BITS_PER_ELEMENT = {
    Format.BF16: 16.0,
    Format.MXFP8: 8.0 + 8.0 / MXFP8_BLOCK,  # 8.25
    Format.NVFP4: 4.0 + 8.0 / NVFP4_BLOCK,  # 4.5 (+ one fp32 per tensor or token)
    Format.FP8_BLOCK: 8.0 + 32.0 / (128 * 128),
}


def block_along_k(fmt: Format | str) -> int:
    """How many consecutive elements of the last (reduction) dim share one scale."""
    fmt = Format(fmt)
    if fmt is Format.MXFP8:
        return MXFP8_BLOCK
    if fmt is Format.NVFP4:
        return NVFP4_BLOCK
    if fmt is Format.FP8_BLOCK:
        return FP8_BLOCK_WEIGHT[1]
    return 1
