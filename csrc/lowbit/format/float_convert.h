// Host conversions between float32 and the 16-bit float formats (bfloat16,
// IEEE half), round-to-nearest-even, used by the CPU kernels. CUDA kernels use
// the hardware intrinsics, which round the same way.
#pragma once

#include "lowbit/common.h"

namespace lowbit {

inline float bf16_bits_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16_bits(float x) {
  uint32_t u = float_bits(x);
  if (is_nan(x)) return static_cast<uint16_t>((u >> 16) | 0x40u);  // keep sign, force quiet
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float half_bits_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    // subnormal: mant * 2^-24, exact in float32
    float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t float_to_half_bits(float x) {
  uint32_t u = float_bits(x);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {
    // result is subnormal in half (|x| < 2^-14): round |x| / 2^-24 to an integer
    float v = bits_float(a) * 16777216.0f;  // exact: power-of-two scaling
    // round half to even without depending on the FP environment
    uint32_t i = static_cast<uint32_t>(v);
    float frac = v - static_cast<float>(i);
    if (frac > 0.5f || (frac == 0.5f && (i & 1u))) ++i;
    return static_cast<uint16_t>(sign | i);
  }
  // normal: rebias exponent from 127 to 15 and round 23 -> 10 mantissa bits
  a += 0xfffu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((a - (112u << 23)) >> 13));
}

}  // namespace lowbit
