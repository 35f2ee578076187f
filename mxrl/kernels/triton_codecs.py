"""Element and scale codecs as Triton device functions, bit-exact with `mxrl.formats.codecs`.

Every function gives the same bytes whether it is emulated (Triton's CPU interpreter) or compiled
for sm_90; where the two differ the kernels take a constexpr `HW` (True on CUDA):
- E8M0 codes and power-of-two reciprocals are integer operations on fp32 bit patterns (spec
  §2.2, §1.3), never a float log2 or a cast to float8_e8m0fnu.
- E4M3, HW: `.to(tl.float8e4nv)`, which Triton lowers on sm_90 to `cvt.rn.satfinite.e4m3x2.f32`
  (RNE; finite overflow and ±Inf -> ±448; ±NaN -> 0x7F), then a select that writes 0x7F for
  ±Inf too (mxrl's non-finite policy: never a finite byte for a non-finite value): the
  reference's clamp -> cast -> 0x7F for non-finite. `e4m3_encode` pays its own compare;
  `e4m3_encode_masked` reuses the is-finite mask of x the amax already computed (MXFP8 and
  block FP8 elements). Not HW: an exact integer encoder (RNE on the fp32 bit pattern, NaN and
  Inf bit patterns -> 0x7F), since the interpreter's fp8 cast does not round to nearest even
  (nor saturate). The GPU tests compare the two on every bf16 value and 2^24 random fp32 bit
  patterns.
- E2M1: RNE by exact fp32 arithmetic (one power-of-two multiply and one 2^23 add), checked in
  the interpreter tests against the reference's threshold table on every bf16 value, random
  fp32 bit patterns and every rounding edge ±1 ulp; NaN -> +6 (0x7), sign of zero kept.
- Finite in, finite out: at the E8M0 scale 2^120 (code 247, the top one a finite amax gives)
  MXFP8 and ue8m0 block-FP8 elements saturate to ±240, not ±448 (`e4m3_limit`,
  `e4m3_encode_limited`): 256 x 2^120 would dequantize to +Inf. The reference's clamp.
- NaN, Inf and min/max: every amax is over the finite elements only (the reference's
  `block_amax`): `finite_abs` maps NaN and ±Inf to 0 with one compare + select per element
  before the max, so no max ever sees a NaN (the GPU's max.f32 would return the non-NaN operand
  where the interpreter's np.maximum propagates NaN) or an Inf, and the compiled and
  interpreted kernels run the same code. Elsewhere min/max never see a NaN that could reach
  the output (the amaxes, hence the scales, are finite).
- Every fp32 division is `tl.div_rn` (IEEE `div.rn.f32`; plain `/` lowers to the approximate
  `div.full.f32`), with operands of one shape (div_rn does not broadcast on the GPU). The
  quantizers have no a*b+c except in `e2m1_encode` and NVFP4 4over6's error (`e2m1 * s - u`),
  where the product is exact, so FMA contraction cannot change a result; an inexact product
  that feeds an add (4over6's u = x * S_enc and its squares) goes through `mul_rn`, which
  the compiler cannot contract. No fp32 op is flushed to zero (no .ftz in the PTX).

- Decoders (E4M3, E2M1) and the bf16 store serve the dequantize paths: exact values, one
  round to nearest even into bf16 (`store_bf16`).

This module imports triton: import it only where triton is available (the triton backend).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxrl.formats import constants as C

# --- fp32 constants, exact (rebuilt from bit patterns in formats.constants) -------------------
E4M3_MAX: tl.constexpr = tl.constexpr(C.E4M3_MAX)
FLT_MAX: tl.constexpr = tl.constexpr(C.FLT_MAX)
RCP_448: tl.constexpr = tl.constexpr(C.RCP_448)
RCP_6: tl.constexpr = tl.constexpr(C.RCP_6)
NVFP4_NUMERATOR: tl.constexpr = tl.constexpr(C.NVFP4_GLOBAL_NUMERATOR)
E8M0_MAX_CODE: tl.constexpr = tl.constexpr(C.E8M0_MAX_CODE)
E8M0_NAN_CODE: tl.constexpr = tl.constexpr(C.E8M0_NAN_CODE)
F32_2_POW_M127_BITS: tl.constexpr = tl.constexpr(C.F32_2_POW_M127_BITS)
F32_HALF_SUBNORMAL: tl.constexpr = tl.constexpr(C.F32_HALF_SUBNORMAL)
E4M3_NAN_CODE: tl.constexpr = tl.constexpr(C.E4M3_NAN_CODE)
E4M3_MAX_BITS: tl.constexpr = tl.constexpr(0x43E00000)  # 448.0
E8M0_OVERFLOW_CODE: tl.constexpr = tl.constexpr(C.E8M0_OVERFLOW_CODE)
E4M3_MAX_AT_OVERFLOW_CODE: tl.constexpr = tl.constexpr(C.E4M3_MAX_AT_OVERFLOW_CODE)
E4M3_MIN_NORMAL_BITS: tl.constexpr = tl.constexpr(0x3C800000)  # 2^-6
# Subnormal E4M3 step is 2^-9: adding 2^14 (ulp 2^-9) rounds |v| < 2^-6 to a multiple of it.
E4M3_SUBNORMAL_MAGIC: tl.constexpr = tl.constexpr(16384.0)
E4M3_SUBNORMAL_MAGIC_BITS: tl.constexpr = tl.constexpr(0x46800000)
# fp32 (exponent << 3 | top 3 mantissa bits) minus this = E4M3 code, for |v| >= 2^-6.
E4M3_REBIAS: tl.constexpr = tl.constexpr((127 - 7) << 3)


E2M1_MAX_BITS: tl.constexpr = tl.constexpr(0x40C00000)  # 6.0
F32_INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)  # |bits| >= this: Inf or NaN
F32_NEG_INF_BITS: tl.constexpr = tl.constexpr(-8388608)  # 0xFF800000 as int32
RNE_MAGIC: tl.constexpr = tl.constexpr(8388608.0)  # 2^23: x + 2^23 rounds x in [0, 2^22] to int
RNE_MAGIC_BITS: tl.constexpr = tl.constexpr(0x4B000000)
F32_QNAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)  # a NaN: the bf16 store canonicalises it
SIGN_BIT: tl.constexpr = tl.constexpr(-(2**31))  # 0x80000000 as int32
BF16_CPU_NAN: tl.constexpr = tl.constexpr(0x7FC0)  # torch's scalar CPU conversion of any NaN

# --- format codes: the kernels' FMT constexpr and the dequantize op's `fmt` argument ----------
FMT_MXFP8: tl.constexpr = tl.constexpr(0)
FMT_NVFP4: tl.constexpr = tl.constexpr(1)
FMT_FP8_BLOCK: tl.constexpr = tl.constexpr(2)


@triton.jit
def load_tile(ptrs, mask, EVEN: tl.constexpr):
    """Load (masked, 0 outside) unless the launcher proved the tile in bounds (EVEN)."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def store_tile(ptrs, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def store_row_scales(
    s_ptr, s, rows, row_mask, kb0, NUM_KB, NUM_B: tl.constexpr, EVEN: tl.constexpr
):
    """s [ROWS, NUM_B]: the scales of blocks kb0 .. kb0 + NUM_B - 1 along K of `rows`, stored
    into the row-major [M, NUM_KB] scale tensor at s_ptr (masked to row_mask and NUM_KB unless
    EVEN)."""
    kb = kb0 + tl.arange(0, NUM_B)
    s_mask = row_mask[:, None] & (kb < NUM_KB)[None, :]
    store_tile(s_ptr + rows[:, None] * NUM_KB + kb[None, :], s, s_mask, EVEN)


@triton.jit
def is_finite(x):
    """x is neither NaN nor ±Inf (one compare: NaN compares false)."""
    return tl.abs(x) <= FLT_MAX


@triton.jit
def finite_abs(x):
    """|x|, with NaN and ±Inf -> 0: what every amax of the kernels is taken over."""
    mag = tl.abs(x)
    return tl.where(mag <= FLT_MAX, mag, 0.0)


@triton.jit
def finite_amax(x, axis):
    """max |x| along `axis` over the finite elements (a block with none gives 0), as the
    reference's `block_amax`. Identical on the GPU and in the interpreter: no NaN or Inf
    reaches the max (module docstring)."""
    return tl.max(finite_abs(x), axis=axis)


@triton.jit
def ceil_e8m0(a):
    """Smallest E8M0 code with 2^(code-127) >= a, fp32 a >= 0 and not NaN -> int32 (§2.2).

    +Inf -> 254 (satfinite); 0 -> 0; the fp32-subnormal rule of TE/torchao."""
    bits = a.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = tl.where(exponent == 0, mantissa > F32_HALF_SUBNORMAL, mantissa != 0)
    code = exponent + round_up.to(tl.int32)
    return tl.minimum(code, E8M0_MAX_CODE)


@triton.jit
def e8m0_reciprocal(code):
    """Exact fp32 2^(127-code) for int32 code in 0..254 (§1.3 `exp2f_rcp`); 254 -> 2^-127."""
    bits = tl.where(code == E8M0_MAX_CODE, F32_2_POW_M127_BITS, (E8M0_MAX_CODE - code) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_f32(code):
    """fp32 2^(code-127) for int32 code in 0..254; code 0 -> 2^-127 (subnormal)."""
    bits = tl.where(code == 0, F32_2_POW_M127_BITS, code << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_encode(v, HW: tl.constexpr):
    """fp32 -> E4M3 byte (uint8): RNE, finite overflow saturates to ±448; NaN, ±Inf -> 0x7F."""
    if HW:
        # One cvt.rn.satfinite.e4m3x2.f32 per two values: it saturates finite overflow and
        # ±Inf to ±448 and writes 0x7F for ±NaN (spec §1.5, verified on the H200); the select
        # then turns ±Inf's ±448 into 0x7F: the reference's clamp -> cast -> 0x7F for
        # non-finite. test_hardware_e4m3_cast_equals_exact_encoder checks it against the
        # integer encoder on every bf16 value and 2^24 random fp32 ones.
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(is_finite(v), code, E4M3_NAN_CODE).to(tl.uint8)
    else:
        return e4m3_encode_exact(v)


@triton.jit
def e4m3_encode_masked(v, finite, HW: tl.constexpr):
    """`e4m3_encode(v, HW)` where the caller already holds `finite` = is_finite(v): v = x times a
    finite non-zero scale that cannot overflow (MXFP8, block FP8), so v is finite exactly where x
    is, and the mask the amax needed saves the HW branch its compare (one select per element)."""
    if HW:
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(finite, code, E4M3_NAN_CODE).to(tl.uint8)
    else:
        return e4m3_encode_exact(v)


@triton.jit
def e4m3_limit(code):
    """The E4M3 cap of elements under E8M0 scale `code` (int32), as the reference's
    `codecs.e4m3_limit`: 448, or 240 from code 247 (2^120) up, where 256 x 2^120 is +Inf."""
    return tl.where(code >= E8M0_OVERFLOW_CODE, E4M3_MAX_AT_OVERFLOW_CODE, E4M3_MAX)


@triton.jit
def e4m3_encode_limited(v, limit, finite, HW: tl.constexpr):
    """`e4m3_encode_masked(v, finite, HW)` with finite values saturating to ±limit (an E4M3
    value <= 448, v's shape) instead of ±448: the reference's `e4m3_encode(x, limit)`. HW: one
    min and one max before the cvt (a NaN there is replaced by the select on `finite`)."""
    if HW:
        clamped = tl.minimum(tl.maximum(v, -limit), limit)
        code = clamped.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(finite, code, E4M3_NAN_CODE).to(tl.uint8)
    else:
        return _e4m3_encode_exact(v, limit.to(tl.int32, bitcast=True))


@triton.jit
def e4m3_encode_exact(v):
    """Integer E4M3 encoder: round to nearest even on the fp32 bit pattern, finite overflow
    saturating; NaN and ±Inf -> 0x7F."""
    return _e4m3_encode_exact(v, E4M3_MAX_BITS)


@triton.jit
def _e4m3_encode_exact(v, limit_bits):
    """`e4m3_encode_exact`, finite magnitudes saturating at the fp32 bit pattern `limit_bits`
    (of an E4M3 value: the rounding below leaves it as it is)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    non_finite = mag >= F32_INF_BITS
    mag = tl.minimum(mag, limit_bits)  # saturate finite overflow to the limit (448)
    # Normal E4M3 (|v| >= 2^-6): drop 20 mantissa bits with RNE; a carry moves the exponent.
    rounded = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (rounded >> 20) - E4M3_REBIAS
    # Subnormal E4M3: one IEEE add rounds |v| to a multiple of 2^-9 (ties to even).
    snapped = mag.to(tl.float32, bitcast=True) + E4M3_SUBNORMAL_MAGIC
    subnormal = snapped.to(tl.int32, bitcast=True) - E4M3_SUBNORMAL_MAGIC_BITS
    code = tl.where(mag >= E4M3_MIN_NORMAL_BITS, normal, subnormal) | sign
    code = tl.where(non_finite, E4M3_NAN_CODE, code)
    return code.to(tl.uint8)


@triton.jit
def e4m3_decode_nonneg(code):
    """E4M3 code 0..0x7E (int32, sign bit clear) -> its exact fp32 value."""
    normal_bits = ((code >> 3) + (127 - 7)) << 23 | ((code & 7) << 20)
    normal = normal_bits.to(tl.float32, bitcast=True)
    subnormal = (code & 7).to(tl.float32) * 0.001953125  # m * 2^-9, exact
    return tl.where(code >= 8, normal, subnormal)


@triton.jit
def e2m1_encode(v):
    """fp32 -> E2M1 code 0..15 (int32): RNE, saturating to ±6, sign of zero kept, NaN -> 0x7
    (spec §1.5; the bins of `constants.E2M1_RNE_THRESHOLDS`).

    The E2M1 grid has step 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6]: with k = 0, 1, 2 for
    those ranges (from |v|'s exponent), code = RNE(|v| * 2^(1-k)) + 2k, and the RNE of a value
    in [0, 4] is one IEEE add of 2^23. |v| * 2^(1-k) is exact, so an FMA contraction of the
    multiply and the add gives the same bits. |v| is saturated on its bit pattern (NaN and Inf
    become 6.0 there, identically on the GPU and in the interpreter); the sign bit is set for
    negative non-NaN values only (as int32 those are the bit patterns <= that of -Inf)."""
    bits = v.to(tl.int32, bitcast=True)
    mag_bits = tl.minimum(bits & 0x7FFFFFFF, E2M1_MAX_BITS)
    k = tl.maximum((mag_bits >> 23) - 127, 0)  # 0, 1, 2 (mag <= 6)
    step_inv = ((128 - k) << 23).to(tl.float32, bitcast=True)  # 2, 1, 0.5
    snapped = mag_bits.to(tl.float32, bitcast=True) * step_inv + RNE_MAGIC
    code = (snapped.to(tl.int32, bitcast=True) - RNE_MAGIC_BITS) + 2 * k
    return tl.where(bits <= F32_NEG_INF_BITS, code | 0x8, code)


@triton.jit
def mul_rn(a, b, HW: tl.constexpr):
    """fl(a * b) for a, b of one shape, never fused with an add that uses it. HW: PTX
    `mul.rn.f32` in inline asm (ptxas does not contract a multiply with an explicit rounding
    mode, and LLVM does not see into the asm); the interpreter's NumPy multiply never fuses."""
    if HW:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def nvfp4_encode_scale(amax):
    """S_enc = fl(2688 / amax) capped at FLT_MAX; 0 or Inf amax -> 1 (spec §3.2). The kernels'
    amaxes are finite (`finite_amax`), and so must a caller's be (`nvfp4.caller_amax`)."""
    s_enc = tl.div_rn(tl.full(amax.shape, NVFP4_NUMERATOR, tl.float32), amax)
    s_enc = tl.minimum(s_enc, FLT_MAX)
    bad = (amax == 0.0) | (s_enc == 0.0)
    return tl.where(bad, 1.0, s_enc)


# --- decoders and the bf16 store of the dequantize paths (triton_dequant, triton_mxfp8) ----
@triton.jit
def nan_like(x_int):
    """A NaN of int32 x's shape (a NaN constexpr cannot be shared by jit functions: Triton
    compares their globals by value, and NaN != NaN)."""
    return (x_int * 0 + F32_QNAN_BITS).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_decode(code):
    """E4M3 byte (int32 0..255) -> fp32, exact; 0x7F / 0xFF -> NaN, 0x80 -> -0.0."""
    mag = code & 0x7F
    value = e4m3_decode_nonneg(mag)
    value = tl.where(mag == 0x7F, nan_like(mag), value)
    return with_sign(value, code >= 0x80)


@triton.jit
def e2m1_decode(code):
    """E2M1 code (int32 0..15) -> fp32 (0, .5, 1, 1.5, 2, 3, 4, 6; code 8 -> -0.0)."""
    mag = code & 7
    exp_m1 = (mag >> 1) - 1  # 0, 1, 2 for 2..3, 4..5, 6..7
    normal = (((exp_m1 + 127) << 23) | ((mag & 1) << 22)).to(tl.float32, bitcast=True)
    value = tl.where(mag >= 2, normal, mag.to(tl.float32) * 0.5)
    return with_sign(value, code >= 8)


@triton.jit
def with_sign(value, negative):
    """value with its sign bit set where `negative` (-0.0 for a zero: `-x` lowers to 0 - x)."""
    bits = value.to(tl.int32, bitcast=True) | tl.where(negative, SIGN_BIT, 0)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits_rne(value):
    """fp32 -> bf16 bit pattern (int16) by round to nearest even on the bits; NaN -> 0x7FC0."""
    bits = value.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, BF16_CPU_NAN, rounded & 0xFFFF).to(tl.int16)


@triton.jit
def store_bf16(ptrs, value, mask, HW: tl.constexpr):
    """Store fp32 `value` rounded to bf16 (RNE). HW: `cvt.rn.bf16.f32`, what torch's CUDA
    `.to(bfloat16)` runs, into a bf16 buffer. Not HW (the interpreter): `bf16_bits_rne` into
    the buffer's int16 view (the launcher passes it), since the interpreter's casts are NumPy's."""
    if HW:
        tl.store(ptrs, value.to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptrs, bf16_bits_rne(value), mask=mask)


@triton.jit
def store_error_sums(ptr, part, w, value, finite):
    """What the export measures of one program's 2-D tile while quantizing it, fp32, into
    ptr[3 * part:3 * part + 3]: the SQNR's terms sum w^2 and sum (w - value)^2
    (`mxrl.kernels.api.error_sums`), and the count of non-finite w (the export's NaN/Inf
    check). w: the master's values as the quantizer read them, value: their dequantized codes,
    finite: is_finite(w); w and value 0 outside the tensor (masked loads read 0, which encodes
    to the code 0)."""
    w2, d2, bad = tile_error_sums(w, value, finite)
    tl.store(ptr + 3 * part, w2)
    tl.store(ptr + 3 * part + 1, d2)
    tl.store(ptr + 3 * part + 2, bad)


@triton.jit
def tile_error_sums(w, value, finite):
    """(sum w^2, sum (w - value)^2, count of non-finite w) over a 2-D tile, fp32
    (`store_error_sums`; NVFP4's row loop adds them over its tiles)."""
    d = w - value
    w2 = tl.sum(tl.sum(w * w, axis=1), axis=0)
    d2 = tl.sum(tl.sum(d * d, axis=1), axis=0)
    return w2, d2, tl.sum(tl.sum(tl.where(finite, 0.0, 1.0), axis=1), axis=0)
