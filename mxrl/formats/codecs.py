"""Element and scale codecs: E4M3, E2M1 (nibble packing), E8M0 (spec §1, §2.2, §8).

All functions take and return tensors on any device; inputs are fp32 unless said otherwise and
every step is one eager op, so the result is the same on CPU and GPU.

Policy choices (spec §1.5; docs/formats.md, "Non-finite inputs"):
- E4M3: round to nearest even, finite overflow saturates to ±448 as the hardware
  `cvt.rn.satfinite` does; NaN and ±Inf -> 0x7F (NaN, sign dropped). The hardware writes ±448
  for ±Inf: mxrl does not, so that a non-finite input never comes out as a finite value.
- E2M1: round to nearest even, saturate to ±6; the sign of zero is kept (-0.0 -> 0x8, as
  ml_dtypes and torchao do); NaN -> +6 (0x7, hardware satfinite), ±Inf -> ±6. E2M1 has no
  NaN: NVFP4 marks a block holding NaN/Inf through its E4M3 scale (`nvfp4.py`).
- E8M0 codes are computed with integer bit operations, never `.to(float8_e8m0fnu)` (which rounds
  to nearest, spec §1.3).
"""

from __future__ import annotations

import torch

from mxrl.formats import constants as C


def fdiv(numerator: torch.Tensor | float, denominator: torch.Tensor | float) -> torch.Tensor:
    """One correctly rounded fp32 division, element-wise, on any device.

    Plain `/` is not that in every case: torch evaluates `scalar / tensor` as
    `tensor.reciprocal() * scalar`, and CUDA evaluates `tensor / cpu_scalar` as
    `tensor * (1 / scalar)` -- both round twice. Both operands become fp32 tensors on one device.
    """
    ref = numerator if isinstance(numerator, torch.Tensor) else denominator
    assert isinstance(ref, torch.Tensor)
    return torch.div(_f32(numerator, ref.device), _f32(denominator, ref.device))


def _f32(v: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """v as an fp32 tensor on `device`; a Python number is filled in place by a kernel (no
    host-to-device copy, which would synchronise a CUDA step)."""
    if isinstance(v, torch.Tensor):
        return v.to(device=device, dtype=torch.float32)
    return torch.full((), v, dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------------------------
# FP8 E4M3
# ----------------------------------------------------------------------------------------------


def e4m3_encode(x: torch.Tensor, limit: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 -> E4M3 byte (uint8): RNE, finite overflow saturates to ±448 (spec §1.5 reference
    recipe); NaN and ±Inf -> 0x7F (mxrl's non-finite policy, not satfinite's ±448).

    limit: a per-element cap (an E4M3 value <= 448, broadcast to x), from `e4m3_limit`: finite
    values saturate to ±limit instead of ±448, so that a value times its block scale stays
    finite (docs/formats.md, "The top of the fp32 range")."""
    assert x.dtype == torch.float32, x.dtype
    if limit is None:
        clamped = torch.clamp(x, -C.E4M3_MAX, C.E4M3_MAX)
    else:
        clamped = torch.minimum(torch.maximum(x, -limit), limit)
    codes = clamped.to(torch.float8_e4m3fn).view(torch.uint8)
    # One canonical NaN byte for NaN of either sign (torch keeps the sign on the CPU, not on
    # CUDA) and for ±Inf (which the clamp above turned into ±448).
    non_finite = ~torch.isfinite(x)
    return torch.where(non_finite, torch.full_like(codes, C.E4M3_NAN_CODE), codes)


def e4m3_limit(scale_codes: torch.Tensor) -> torch.Tensor:
    """The largest E4M3 magnitude an element may take under the E8M0 scale `scale_codes`
    (int tensor, any shape) so that element x scale is finite in fp32: 448, except at the codes
    whose 448 x 2^(c-127) overflows (c >= 247; a finite input reaches 247 at most), where it is
    240 (constants.E4M3_MAX_AT_OVERFLOW_CODE). fp32, scale_codes' shape."""
    top = scale_codes.to(torch.int32) >= C.E8M0_OVERFLOW_CODE
    full = torch.full(top.shape, C.E4M3_MAX, dtype=torch.float32, device=top.device)
    return torch.where(top, torch.full_like(full, C.E4M3_MAX_AT_OVERFLOW_CODE), full)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8 or float8_e4m3fn) -> fp32 values (exact)."""
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    return codes.to(torch.float32)


# ----------------------------------------------------------------------------------------------
# FP4 E2M1
# ----------------------------------------------------------------------------------------------


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 code in 0..15 (one per uint8, unpacked). RNE, saturating, signed zero kept."""
    assert x.dtype == torch.float32, x.dtype
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, inclusive in C.E2M1_RNE_THRESHOLDS:
        step = (mag >= threshold) if inclusive else (mag > threshold)
        code += step.to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    code = code | sign
    # NaN compares false everywhere (code 0 or 8 so far): satfinite sends it to +6.
    return torch.where(torch.isnan(x), torch.full_like(code, 0x7), code)


_E2M1_TABLE_CACHE: dict[torch.device, torch.Tensor] = {}


def _e2m1_table(device: torch.device) -> torch.Tensor:
    table = _E2M1_TABLE_CACHE.get(device)
    if table is None:
        pos = list(C.E2M1_VALUES)
        table = torch.tensor(pos + [-v for v in pos], dtype=torch.float32, device=device)
        _E2M1_TABLE_CACHE[device] = table
    return table


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15, unpacked uint8) -> fp32 values (code 8 decodes to -0.0)."""
    return _e2m1_table(codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes 0..15 -> [..., K/2] bytes; element 2i in the low nibble (spec §1.2)."""
    assert codes.shape[-1] % 2 == 0, codes.shape
    lo = codes[..., 0::2]
    hi = codes[..., 1::2]
    return lo | (hi << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes 0..15 (inverse of `pack_nibbles`)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ----------------------------------------------------------------------------------------------
# E8M0
# ----------------------------------------------------------------------------------------------


def _f32_fields(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = a.contiguous().view(torch.int32)
    exponent = (bits >> C.F32_MANTISSA_BITS) & C.F32_EXP_MASK
    mantissa = bits & C.F32_MANTISSA_MASK
    return exponent, mantissa


def ceil_e8m0(a: torch.Tensor) -> torch.Tensor:
    """Smallest E8M0 code whose value is >= a, for fp32 a >= 0 (spec §2.2 `ceil_e8m0`).

    NaN -> 255; +Inf -> 254 (satfinite); 0 -> 0; the fp32-subnormal rule of TE/torchao.
    """
    assert a.dtype == torch.float32, a.dtype
    exponent, mantissa = _f32_fields(a)
    round_up = mantissa != 0
    # E == 0 (subnormal): 2^-127 = 0x400000 already covers F <= 0x400000 with code 0.
    round_up = torch.where(exponent == 0, mantissa > C.F32_HALF_SUBNORMAL, round_up)
    code = exponent + round_up.to(torch.int32)
    code = torch.clamp(code, max=C.E8M0_MAX_CODE)
    code = torch.where(torch.isinf(a), torch.full_like(code, C.E8M0_MAX_CODE), code)
    code = torch.where(torch.isnan(a), torch.full_like(code, C.E8M0_NAN_CODE), code)
    return code.to(torch.uint8)


def floor_e8m0(a: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """OCP MX rule (torchao's FLOOR default): code = floor(log2 a) - emax_elem + 127.

    The unbiased exponent is clamped to [-127, 128] (128 is the NaN code 255), NaN -> 255,
    as torchao's `to_mx` does (spec §2.2 OCP FLOOR). For comparison only; RCEIL is the default.
    """
    assert a.dtype == torch.float32, a.dtype
    exponent, _ = _f32_fields(a)
    unbiased = exponent - C.E8M0_BIAS - emax_elem
    unbiased = torch.clamp(unbiased, -C.E8M0_BIAS, C.E8M0_BIAS + 1)
    code = unbiased + C.E8M0_BIAS
    code = torch.where(torch.isnan(a), torch.full_like(code, C.E8M0_NAN_CODE), code)
    return code.to(torch.uint8)


def e8m0_to_f32(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8 or float8_e8m0fnu) -> fp32 2^(code-127); code 0 -> 2^-127; 255 -> NaN."""
    if codes.dtype == torch.float8_e8m0fnu:
        codes = codes.view(torch.uint8)
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, C.F32_2_POW_M127_BITS), c << C.F32_MANTISSA_BITS)
    out = bits.view(torch.float32)
    return torch.where(c == C.E8M0_NAN_CODE, torch.full_like(out, float("nan")), out)


def e8m0_reciprocal(codes: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^(127-code) (spec §1.3 `exp2f_rcp`): code 254 -> 2^-127, 255 -> NaN."""
    if codes.dtype == torch.float8_e8m0fnu:
        codes = codes.view(torch.uint8)
    c = codes.to(torch.int32)
    bits = torch.where(
        c == C.E8M0_MAX_CODE,
        torch.full_like(c, C.F32_2_POW_M127_BITS),
        (C.E8M0_MAX_CODE - c) << C.F32_MANTISSA_BITS,
    )
    out = bits.view(torch.float32)
    return torch.where(c == C.E8M0_NAN_CODE, torch.full_like(out, float("nan")), out)
