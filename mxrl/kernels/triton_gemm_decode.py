"""Decoding of the low-bit GEMM's operands in registers (Triton device functions for
`triton_gemm.py`): NVFP4 codes to fp16 even/odd halves (inline PTX on sm_90, or Triton ops),
MXFP8 bytes to fp16 or fp32 values, fp32 -> bf16 rounding for the interpreter. Every function
returns exact values (the module docstring of triton_gemm.py has the argument); HW False is
Triton's interpreter, which has neither the hardware cvt nor inline PTX.

This module imports triton: import it only where triton is available (the triton backend).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxrl.kernels.triton_codecs import e4m3_decode_nonneg, e8m0_to_f32

F16_TO_E4M3: tl.constexpr = tl.constexpr(256.0)  # E4M3 bits placed in fp16 read as value * 2^-8
F32_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)


# NVFP4 decode on sm_90 (NV_ASM): four packed bytes (eight E2M1 codes) per call. Each nibble is
# moved into an E4M3 byte that reads as the E2M1 value times 2^-6 (the E2M1 bits s.ee.m placed at
# E4M3 bits 7 and 4..2; the subnormal 0.5 lands on the E4M3 subnormal 2^-7), four bytes at once
# with shifts and masks (no bit crosses a byte: the masks keep each byte's own bits), converted by
# the hardware cvt (e4m3x2 -> f16x2) and multiplied by the block scale times 2^6 in f16x2.
# Every value on the way is a normal fp16 and every product exact: lp = e2m1 * s_block lies in
# [2^-10, 2688] with at most 6 significant bits. $0,$1: even elements (low nibbles), $2,$3: odd
# elements (high nibbles), each f16x2 in the element order of the packed input bytes $4; $5,$6:
# the scale (times 2^6) of each input byte, f16x2.
# one line (no newlines in the string: torch.compile re-emits the kernel source)
NVFP4_DECODE_ASM: tl.constexpr = tl.constexpr(
    " ".join(
        [
            "{",
            ".reg .b32 lo, hi, t, u;",
            ".reg .b16 l0, l1, h0, h1;",
            "shl.b32 t, $4, 2;",
            "and.b32 t, t, 0x1C1C1C1C;",
            "shl.b32 u, $4, 4;",
            "and.b32 u, u, 0x80808080;",
            "or.b32 lo, t, u;",
            "shr.b32 t, $4, 2;",
            "and.b32 t, t, 0x1C1C1C1C;",
            "and.b32 u, $4, 0x80808080;",
            "or.b32 hi, t, u;",
            "mov.b32 {l0, l1}, lo;",
            "mov.b32 {h0, h1}, hi;",
            "cvt.rn.f16x2.e4m3x2 $0, l0;",
            "cvt.rn.f16x2.e4m3x2 $1, l1;",
            "cvt.rn.f16x2.e4m3x2 $2, h0;",
            "cvt.rn.f16x2.e4m3x2 $3, h1;",
            "mul.rn.f16x2 $0, $0, $5;",
            "mul.rn.f16x2 $1, $1, $6;",
            "mul.rn.f16x2 $2, $2, $5;",
            "mul.rn.f16x2 $3, $3, $6;",
            "}",
        ]
    )
)
E4M3_PER_E2M1: tl.constexpr = tl.constexpr(64.0)  # the E4M3 image of an E2M1 code is value * 2^-6


@triton.jit
def f16_bits_to_f32(bits):
    """int32 holding an fp16 bit pattern (0..0xFFFF) -> its exact fp32 value."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_to_f32(b, HW: tl.constexpr):
    """E4M3 bytes (uint8 or int32 0..255) -> exact fp32 values; 0x7F / 0xFF -> NaN.

    HW: the sm_90 cvt (e4m3x2 -> f16x2). Otherwise the byte shifted into fp16 bits reads as the
    E4M3 value times 2^-8, subnormals included (the interpreter's fp8 casts are not exact)."""
    if HW:
        return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        b = b.to(tl.int32)
        v = f16_bits_to_f32(((b & 0x7F) << 7) | ((b & 0x80) << 8)) * F16_TO_E4M3
        nan = tl.full(b.shape, F32_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
        return tl.where((b & 0x7F) == 0x7F, nan, v)


@triton.jit
def e4m3_to_f16(b, HW: tl.constexpr):
    """E4M3 bytes -> fp16 (exact: every E4M3 value is a normal fp16; NaN stays NaN)."""
    if HW:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        return e4m3_to_f32(b, HW).to(tl.float16)


@triton.jit
def nvfp4_halves(q, s, R: tl.constexpr, BK: tl.constexpr, HW: tl.constexpr, NV_ASM: tl.constexpr):
    """Packed E2M1 bytes [R, BK/2] and E4M3 block-scale bytes [R, BK/16] -> (lp of the even
    elements, lp of the odd elements), each fp16 [R, BK/2] (exact: see NVFP4_DECODE_ASM).

    The two halves feed two dots (even K, then odd K): the same sum as one dot over K."""
    if HW:
        s16 = s.to(tl.float8e4nv, bitcast=True).to(tl.float16) * E4M3_PER_E2M1
    else:
        s16 = (e4m3_decode_nonneg(s.to(tl.int32)) * E4M3_PER_E2M1).to(tl.float16)
    s16 = tl.reshape(
        tl.broadcast_to(tl.reshape(s16, [R, BK // 16, 1]), [R, BK // 16, 8]), [R, BK // 2]
    )
    if NV_ASM:
        lo, hi = tl.inline_asm_elementwise(
            NVFP4_DECODE_ASM,
            "=r,=r,=r,=r,r,r,r",
            [q, s16],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        # the same bytes as the asm, one at a time
        b = q.to(tl.int32)
        lo_e4m3 = ((b << 2) & 0x1C) | ((b << 4) & 0x80)
        hi_e4m3 = ((b >> 2) & 0x1C) | (b & 0x80)
        lo = e4m3_to_f32(lo_e4m3, HW).to(tl.float16) * s16
        hi = e4m3_to_f32(hi_e4m3, HW).to(tl.float16) * s16
    return lo, hi


@triton.jit
def mxfp8_values(q, s, R: tl.constexpr, BK: tl.constexpr, HW: tl.constexpr):
    """E4M3 bytes [R, BK] and E8M0 scale bytes [R, BK/32] -> lp fp32 [R, BK] (exact)."""
    v = e4m3_to_f32(q, HW)
    scale = e8m0_to_f32(s.to(tl.int32))  # [R, BK/32]
    v = tl.reshape(v, [R, BK // 32, 32]) * scale[:, :, None]
    return tl.reshape(v, [R, BK])


@triton.jit
def bf16_rne(v):
    """fp32 -> bf16 rounding to nearest even on the bit pattern (finite values; NaN stays NaN)."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(v != v, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
