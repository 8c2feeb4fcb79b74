// FP8 training formats: the E5M2 codec (E4M3's lives in
// format/nvfp4_format.h and is shared), the scale rule and the element rule,
// usable on host and device so that the CPU reference and the CUDA kernels
// agree bit for bit. docs/fp8.md states the same rules for readers.
//
// Rules (float32, each operation rounded once, as written):
//   scale   s = amax / fmax, then * 2^margin (exact), then rounded up to a
//           power of two when pow2 is set; amax == 0 gives s = 1; a scale
//           that underflows to 0 becomes the smallest positive float (so
//           zeros stay zeros instead of 0/0).
//   element q = fp8(x / s): an IEEE division (not a reciprocal multiply,
//           which differs in the last bit of some quotients and so in some
//           codes), rounded to nearest even, saturating at +-fmax (also
//           +-inf); NaN becomes the NaN code 0x7f whatever its sign.
//   value   q * s (the GEMMs multiply the scales back in FP32).
// Non-finite input: amax reductions propagate NaN, so a NaN in a scaling
// group gives s = NaN and every code of the group NaN; +-inf gives s = inf,
// finite elements become +-0 and the inf itself NaN (inf / inf), so the
// group dequantizes to NaN or 0 * inf = NaN: never to finite garbage. With a
// caller-given scale (delayed scaling) +-inf saturates to +-fmax; its amax
// (inf) still reaches the history.
#pragma once

#include "lowbit/common.h"
#include "lowbit/format/nvfp4_format.h"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace lowbit::fp8 {

enum class Format : int32_t { kE4M3 = 0, kE5M2 = 1 };

// How one tensor [rows, cols] is scaled (cols is the GEMM's reduction dim):
//   kTensor   one scale;
//   kRow      one per row (amax over cols);
//   kBlock    one per 1 x 128 tile along cols: [rows, ceil(cols / 128)];
//   kBlock2d  one per 128 x 128 tile: [ceil(rows / 128), ceil(cols / 128)].
// Edge tiles take the amax of the elements they hold.
enum class Scaling : int32_t { kTensor = 0, kRow = 1, kBlock = 2, kBlock2d = 3 };

constexpr int kBlockSize = 128;
constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr uint8_t kNaNCode = 0x7f;  // E4M3 and E5M2 alike

LOWBIT_HD float format_max(Format f) { return f == Format::kE4M3 ? kE4M3Max : kE5M2Max; }

// ---- E5M2 -------------------------------------------------------------------

// Round to nearest E5M2 code, ties to even, saturating finite values and
// infinities at +-57344 (code 0x7b); NaN becomes 0x7f whatever its sign.
LOWBIT_HD uint8_t float_to_e5m2(float x) {
  if (is_nan(x)) return kNaNCode;
#if defined(__CUDA_ARCH__)
  // hardware cvt.rn.satfinite (sm_89+); tests/cpp checks the host code
  // against the toolkit's conversion
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2));
#else
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x47600000u) return static_cast<uint8_t>(sign | 0x7bu);  // |x| >= 57344
  if (a < 0x38800000u) {
    // below 2^-14: subnormal codes k * 2^-16, k in 0..4 (4 is the smallest normal)
    return static_cast<uint8_t>(sign | nvfp4::round_half_even_u32(bits_float(a) * 65536.0f));
  }
  // normal: round the 23-bit mantissa to 2 bits, rebias the exponent 127 -> 15
  a += 0xfffffu + ((a >> 21) & 1u);
  uint32_t code = (a >> 21) - (112u << 2);
  if (code > 0x7bu) code = 0x7bu;
  return static_cast<uint8_t>(sign | code);
#endif
}

LOWBIT_HD float e5m2_to_float(uint32_t code) {
  const uint32_t sign = (code & 0x80u) << 24;
  const uint32_t exp = (code >> 2) & 31u;
  const uint32_t mant = code & 3u;
  if (exp == 31u) return bits_float(sign | 0x7f800000u | (mant << 21));  // inf, NaN
  if (exp == 0u) {
    const float v = static_cast<float>(mant) * 1.52587890625e-05f;  // mant * 2^-16, exact
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 21));
}

LOWBIT_HD uint8_t float_to_fp8(float x, Format f) {
  return f == Format::kE4M3 ? nvfp4::float_to_e4m3(x) : float_to_e5m2(x);
}

LOWBIT_HD float fp8_to_float(uint32_t code, Format f) {
  return f == Format::kE4M3 ? nvfp4::e4m3_to_float(code) : e5m2_to_float(code);
}

// ---- the rules ----------------------------------------------------------------

LOWBIT_HD float div_rn(float x, float d) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(x, d);
#else
  return x / d;
#endif
}

// The smallest power of two >= s, for finite s > 0 (others unchanged).
// Overflows to inf only above 2^127.
LOWBIT_HD float pow2_ceil(float s) {
  if (!(s > 0.f) || is_nan(s)) return s;
  uint32_t b = float_bits(s);
  if (b >= 0x7f800000u) return s;  // inf
  if (b < 0x00800000u) {           // subnormal: the next power of two of the integer mantissa
    uint32_t p = 1;
    while (p < b) p <<= 1;
    return bits_float(p);
  }
  if ((b & 0x7fffffu) == 0) return s;
  return bits_float((b & 0x7f800000u) + 0x00800000u);
}

// The dequantization scale of a group whose largest |x| is amax.
LOWBIT_HD float scale_from_amax(float amax, float fmax, int margin, bool pow2) {
  if (amax == 0.f) return 1.f;
  float s = div_rn(amax, fmax);
#if defined(__CUDA_ARCH__)
  if (margin != 0) s = ldexpf(s, margin);
#else
  if (margin != 0) s = std::ldexp(s, margin);
#endif
  if (pow2) s = pow2_ceil(s);
  return s == 0.f ? bits_float(1u) : s;
}

LOWBIT_HD uint8_t encode(float x, float scale, Format f) { return float_to_fp8(div_rn(x, scale), f); }

// The element rule's division for the CUDA cast's hot loop: x / s through
// r = 1/s (rounded to nearest) and one Markstein step
// (nvfp4::div_with_reciprocal), with the sign of x (so -0 stays -0). For s
// in [2^-80, 2^100] (fast_division_ok) every quotient of magnitude >= 2^-18
// comes out correctly rounded (x >= 2^-98 keeps the remainder exact), and
// smaller ones stay below 2^-17, E5M2's first rounding midpoint (E4M3's is
// 2^-10), so the FP8 code equals encode()'s; tests/cpp checks it. Other
// scales (tiny, huge, inf, NaN) take div_rn.
LOWBIT_HD bool fast_division_ok(float s) { return s >= 0x1p-80f && s <= 0x1p100f; }

LOWBIT_HD float div_by_scale(float x, float s, float r) {
#if defined(__CUDA_ARCH__)
  return copysignf(nvfp4::div_with_reciprocal(x, s, r), x);
#else
  return std::copysign(nvfp4::div_with_reciprocal(x, s, r), x);
#endif
}

// div_by_scale where x * r cannot overflow: for a scale the cast computed
// from the amax of the elements it divides (scale_from_amax, |margin| <= 64),
// |x / s| <= fmax * 2^64, so the Markstein step is always taken and
// div_with_reciprocal's guard for an infinite x * r is left out (three
// instructions of the cast's hot loop). Same results as div_by_scale there;
// tests/cpp checks it.
LOWBIT_HD float div_by_bounded_scale(float x, float s, float r) {
#if defined(__CUDA_ARCH__)
  const float q0 = __fmul_rn(x, r);
  return copysignf(__fmaf_rn(__fmaf_rn(-q0, s, x), r, q0), x);
#else
  const float q0 = x * r;
  return std::copysign(std::fma(std::fma(-q0, s, x), r, q0), x);
#endif
}

// A power of two in the fast_division_ok range: its reciprocal is exact, so
// x * (1 / s) is x / s correctly rounded (overflow, underflow and the sign of
// zero included), one multiplication per element.
LOWBIT_HD bool pow2_division_ok(float s) { return fast_division_ok(s) && (float_bits(s) & 0x7fffffu) == 0; }

}  // namespace lowbit::fp8
