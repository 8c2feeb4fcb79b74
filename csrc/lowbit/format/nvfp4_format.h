// NVFP4: the element and scale codecs and the reference quantization rule,
// usable on host and device (CPU reference kernels and CUDA kernels share it,
// which is what makes them agree bit for bit).
//
// Format (DESIGN.md):
//   element  E2M1, 4 bits: bit 3 sign, bits 2..0 index {0,.5,1,1.5,2,3,4,6}.
//            Two per byte: element 2j in the low nibble, 2j+1 in the high.
//   block    one FP8 E4M3 (fn: no inf, 0x7f/0xff NaN, max 448) per 16
//            consecutive elements along K.
//   global   one float32 per tensor (or per expert):
//            value = e2m1 * float(block_scale) * global.
//
// Quantization rule (all float32, each operation rounded as written):
//   global  s = amax / 2688                  (2688 = 6 * 448), or caller-given
//   block   b = e4m3(clamp(block_amax / 6 / s, 2^-6, 448))
//   element q = e2m1(clamp(x / (s * float(b)), -6, 6))
// e4m3() and e2m1() round to nearest, ties to the even code; e2m1 keeps the
// sign, so a negative value that rounds to zero is code 8 (-0).
//
// Non-finite input and degenerate scales (tested in tests/cpp):
//   * amax reductions propagate NaN: a block holding a NaN gets the NaN block
//     scale 0x7f and dequantizes to NaN; a NaN anywhere makes s NaN, so the
//     whole tensor dequantizes to NaN.
//   * +-inf makes s = inf: every block scale clamps to 2^-6, every element
//     to +-0, and the tensor dequantizes to NaN (0 * inf). Non-finite input
//     never turns into finite output.
//   * an all-zero tensor gives s = 0; the block ratio is then defined as 0
//     (scale 2^-6) and every element encodes as +-0, dequantizing to zeros.
//   * every element code carries the sign of x; a quotient x / (s * b) that
//     is NaN (its block scale is NaN too, or 0/0 for an all-zero tensor) has
//     magnitude 0; +-inf saturates to +-6 (only with a caller-given scale).
#pragma once

#include "lowbit/common.h"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif
#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace lowbit::nvfp4 {

constexpr int kBlockSize = 16;            // elements per block scale
constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;
constexpr float kE4M3MinNormal = 0.015625f;  // 2^-6
constexpr float kGlobalDivisor = 2688.0f;    // kE2M1Max * kE4M3Max
constexpr uint8_t kE4M3NaN = 0x7f;

// ---- E2M1 -------------------------------------------------------------------

// Round-half-even of v in [0, 2^23), independent of the FP environment.
LOWBIT_HD uint32_t round_half_even_u32(float v) {
  uint32_t i = static_cast<uint32_t>(v);
  float frac = v - static_cast<float>(i);
  if (frac > 0.5f || (frac == 0.5f && (i & 1u))) ++i;
  return i;
}


// Decodes the low 4 bits of `code`. The magnitude bits are an exponent (2 bits,
// bias 1) and one mantissa bit; exponent 0 is the subnormal 0 / 0.5.
LOWBIT_HD float e2m1_to_float(uint32_t code) {
  uint32_t sign = (code & 8u) << 28;
  uint32_t exp = (code >> 1) & 3u;
  uint32_t mant = code & 1u;
  uint32_t mag = exp ? ((exp + 126u) << 23) | (mant << 22) : (mant ? 0x3f000000u : 0u);
  return bits_float(sign | mag);
}

// Magnitude code (0..7) of |q| for |q| <= 6, rounded to nearest with ties to
// the even code. The E2M1 grid has step 0.5 below 2, 1 below 4 and 2 up to 6,
// so scaling |q| by 2, 1 or 1/2 (exact) turns each segment into integers whose
// round-half-even is the code minus an offset: ties to the even integer are
// ties to the even code (midpoints .25 .75 1.25 1.75 2.5 3.5 5 -> 0 2 2 4 4 6 6).
LOWBIT_HD uint32_t e2m1_magnitude_code(float a) {
  const float scale = a < 2.f ? 2.f : (a < 4.f ? 1.f : 0.5f);
  const uint32_t offset = a < 2.f ? 0u : (a < 4.f ? 2u : 4u);
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__float2int_rn(a * scale)) + offset;
#else
  return round_half_even_u32(a * scale) + offset;
#endif
}

// E2M1 code of x: sign of x, magnitude rounded to nearest (ties to even),
// saturating at 6; NaN has magnitude 0 (its sign bit is kept like any other).
LOWBIT_HD uint8_t float_to_e2m1(float x) {
  const uint32_t sign = (float_bits(x) >> 28) & 8u;
  float a = x < 0.f ? -x : x;
  a = a > kE2M1Max ? kE2M1Max : a;
  return static_cast<uint8_t>(sign | (is_nan(a) ? 0u : e2m1_magnitude_code(a)));
}

// ---- E4M3 (fn) --------------------------------------------------------------

LOWBIT_HD float e4m3_to_float(uint32_t code) {
#if defined(__CUDA_ARCH__)
  // hardware cvt (sm_89+): same values, NaN for 0x7f/0xff
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3)));
#endif
  uint32_t sign = (code & 0x80u) << 24;
  uint32_t exp = (code >> 3) & 15u;
  uint32_t mant = code & 7u;
  if (exp == 15u && mant == 7u) return bits_float(0x7fc00000u | sign);
  if (exp == 0u) {
    float v = static_cast<float>(mant) * 0.001953125f;  // mant * 2^-9, exact
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 120u) << 23) | (mant << 20));
}

// Round to nearest E4M3 code, ties to even, saturating finite values and
// infinities at +-448; NaN becomes 0x7f whatever its sign.
LOWBIT_HD uint8_t float_to_e4m3(float x) {
  if (is_nan(x)) return kE4M3NaN;
#if defined(__CUDA_ARCH__)
  // hardware cvt.rn.satfinite (sm_89+): round to nearest even, +-inf and
  // overflow saturate to +-448; tests/cpp checks the host code against it
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
#endif
  uint32_t u = float_bits(x);
  uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7e);  // |x| >= 448
  if (a < 0x3c800000u) {
    // below 2^-6: subnormal codes k * 2^-9, k in 0..8 (8 is the smallest normal)
    return static_cast<uint8_t>(sign | round_half_even_u32(bits_float(a) * 512.0f));
  }
  // normal: round the 23-bit mantissa to 3 bits (carry may bump the exponent),
  // then rebias the exponent from 127 to 7.
  a += 0x7ffffu + ((a >> 20) & 1u);
  uint32_t code = (a >> 20) - (120u << 3);
  if (code > 0x7eu) code = 0x7eu;
  return static_cast<uint8_t>(sign | code);
}

// ---- quantization rule ------------------------------------------------------

LOWBIT_HD float global_scale_from_amax(float amax) { return amax / kGlobalDivisor; }

// Block scale code for a block whose largest |x| is block_amax. clamp keeps a
// NaN ratio (comparisons with NaN are false), which encodes as 0x7f.
LOWBIT_HD uint8_t encode_block_scale(float block_amax, float global_scale) {
  float r = global_scale == 0.f ? 0.f : block_amax / kE2M1Max / global_scale;
  r = r < kE4M3MinNormal ? kE4M3MinNormal : r;
  r = r > kE4M3Max ? kE4M3Max : r;
  return float_to_e4m3(r);
}

// x / d rounded to nearest, given r = 1/d rounded to nearest: one multiply
// and one Markstein correction step instead of a full IEEE division (the
// quantizer's hot loop). For 2^-100 <= d <= 2^100 and |x / d| >= 1/8 the
// remainder x - q0 * d is exactly representable, so by Markstein's theorem the
// result is x / d correctly rounded (tests/cpp checks it against true
// division). Below 1/8 the result may be off by ulps, harmless: the first
// E2M1 threshold is 1/4. An overflowing first estimate is kept as is.
LOWBIT_HD float div_with_reciprocal(float x, float d, float r) {
#if defined(__CUDA_ARCH__)
  const float q0 = __fmul_rn(x, r);
  const float rem = __fmaf_rn(-q0, d, x);
  const float q1 = __fmaf_rn(rem, r, q0);
#else
  const float q0 = x * r;
  const float rem = std::fma(-q0, d, x);
  const float q1 = std::fma(rem, r, q0);
#endif
  return (float_bits(q0) & 0x7fffffffu) == 0x7f800000u ? q0 : q1;
}

// Whether div_with_reciprocal is exact for this divisor (else divide).
LOWBIT_HD bool reciprocal_division_ok(float d) { return d >= 0x1p-100f && d <= 0x1p100f; }

LOWBIT_HD float reciprocal_rn(float d) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(d);
#else
  return 1.0f / d;
#endif
}

// E2M1 code of x given the block's divisor d = global_scale * float(block
// scale) and r = reciprocal_rn(d): e2m1(clamp(x / d, -6, 6)) with the sign of
// x always kept, so zeros (also 0/0 when the scale is 0) and values that
// round to zero keep their sign.
LOWBIT_HD uint8_t encode_element(float x, float d, float r) {
  const float q = reciprocal_division_ok(d) ? div_with_reciprocal(x, d, r) : x / d;
  const uint32_t sign = (float_bits(x) >> 28) & 8u;
#if defined(__CUDA_ARCH__)
  // Branch-free: with ordered compares a NaN falls in the first segment and
  // cvt.rni turns NaN into 0; +inf converts to INT_MAX, so an unsigned min
  // with 7 saturates every |q| >= 6 (and inf) at the top code.
  const float a = fabsf(q);
  const float scale = a >= 4.f ? 0.5f : (a >= 2.f ? 1.f : 2.f);
  const uint32_t offset = a >= 4.f ? 4u : (a >= 2.f ? 2u : 0u);
  const uint32_t code = min(static_cast<uint32_t>(__float2int_rn(a * scale)) + offset, 7u);
  return static_cast<uint8_t>(sign | code);
#else
  float a = std::fabs(q);
  a = is_nan(a) ? 0.f : (a > kE2M1Max ? kE2M1Max : a);
  return static_cast<uint8_t>(sign | e2m1_magnitude_code(a));
#endif
}

// Dequantized element: (e2m1 * block scale) is exact in float32, then one
// rounding when multiplied by the global scale.
LOWBIT_HD float decode_element(uint32_t code, float block_scale, float global_scale) {
  return e2m1_to_float(code) * block_scale * global_scale;
}

}  // namespace lowbit::nvfp4
