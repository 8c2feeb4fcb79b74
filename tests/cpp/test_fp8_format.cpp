// The FP8 training rules of fp8/fp8_format.h: the E5M2 codec exhaustively
// and against the CUDA toolkit's conversion, the scale rule's edge cases
// (zero, NaN, inf, underflow, margin, powers of two), and the CPU cast on a
// small tensor per scaling.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "lowbit/fp8/fp8_cast.h"
#include "lowbit/fp8/fp8_format.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_fp8.h>
#endif

using namespace lowbit;
using namespace lowbit::fp8;

namespace {

float e5m2_by_definition(int code) {
  const int sign = code >> 7, exp = (code >> 2) & 31, mant = code & 3;
  float mag;
  if (exp == 31) mag = mant ? std::numeric_limits<float>::quiet_NaN() : INFINITY;
  else if (exp == 0) mag = std::ldexp(mant / 4.0f, -14);
  else mag = std::ldexp(1.0f + mant / 4.0f, exp - 15);
  return sign ? -mag : mag;
}

TEST(E5M2, DecodesEveryCodeByDefinition) {
  for (int c = 0; c < 256; ++c) {
    const float want = e5m2_by_definition(c), got = e5m2_to_float(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(float_bits(got), float_bits(want)) << c;
    }
  }
}

TEST(E5M2, EveryFiniteCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if (((c >> 2) & 31) == 31) continue;  // inf, NaN
    EXPECT_EQ(float_to_e5m2(e5m2_to_float(c)), c) << c;
  }
}

TEST(E5M2, SaturatesAndMapsNaN) {
  EXPECT_EQ(float_to_e5m2(57344.f), 0x7b);
  EXPECT_EQ(float_to_e5m2(61439.f), 0x7b);
  EXPECT_EQ(float_to_e5m2(1e9f), 0x7b);
  EXPECT_EQ(float_to_e5m2(INFINITY), 0x7b);
  EXPECT_EQ(float_to_e5m2(-INFINITY), 0xfb);
  EXPECT_EQ(float_to_e5m2(std::nanf("")), kNaNCode);
  EXPECT_EQ(float_to_e5m2(-std::nanf("")), kNaNCode);
  EXPECT_EQ(float_to_e5m2(-0.f), 0x80);
  EXPECT_EQ(float_to_e5m2(1.25f), 0x3d);             // exact
  EXPECT_EQ(float_to_e5m2(1.125f), 0x3c);            // tie -> even (1.0)
  EXPECT_EQ(float_to_e5m2(1.375f), 0x3e);            // tie -> even (1.5)
  EXPECT_EQ(float_to_e5m2(std::ldexp(1.f, -17)), 0);  // half the smallest subnormal: tie -> 0
}

#if defined(LOWBIT_WITH_CUDA)
TEST(E5M2, MatchesCudaToolkitConversionOnRandomFloats) {
  std::mt19937 rng(4321);
  std::uniform_real_distribution<float> exponent(-20.f, 17.f);
  std::uniform_int_distribution<int> sign(0, 1);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::exp2(exponent(rng)) * (sign(rng) ? -1.f : 1.f);
    const auto want = static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2));
    ASSERT_EQ(float_to_e5m2(x), want) << x;
  }
}
#endif

TEST(ScaleRule, EdgeCases) {
  EXPECT_EQ(scale_from_amax(0.f, kE4M3Max, 0, false), 1.f);
  EXPECT_EQ(scale_from_amax(448.f, kE4M3Max, 0, false), 1.f);
  EXPECT_EQ(scale_from_amax(448.f, kE4M3Max, 2, false), 4.f);
  EXPECT_EQ(scale_from_amax(448.f, kE4M3Max, -1, false), 0.5f);
  EXPECT_EQ(scale_from_amax(500.f, kE4M3Max, 0, true), 2.f);
  EXPECT_EQ(scale_from_amax(448.f, kE4M3Max, 0, true), 1.f);
  EXPECT_TRUE(std::isnan(scale_from_amax(std::nanf(""), kE4M3Max, 0, true)));
  EXPECT_TRUE(std::isinf(scale_from_amax(INFINITY, kE5M2Max, 0, true)));
  EXPECT_EQ(float_bits(scale_from_amax(bits_float(1u), kE4M3Max, 0, false)), 1u);  // underflow -> 2^-149
  EXPECT_EQ(pow2_ceil(bits_float(3u)), bits_float(4u));                              // subnormal
  EXPECT_EQ(pow2_ceil(std::ldexp(1.f, -130)), std::ldexp(1.f, -130));
  EXPECT_EQ(pow2_ceil(0.75f), 1.f);
}

TEST(ScaleRule, DividesRatherThanMultipliesByTheReciprocal) {
  // Some quotient x / s differs from x * (1 / s) in the last bit; the rule
  // divides, so codes follow the correctly rounded quotient.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.5f, 2.f);
  for (int i = 0; i < 100000; ++i) {
    const float x = u(rng) * 100.f, s = u(rng);
    EXPECT_EQ(encode(x, s, Format::kE4M3), nvfp4::float_to_e4m3(x / s));
  }
}

TEST(ScaleRule, ReciprocalDivisionGivesTheDividedCodes) {
  // The CUDA cast divides through the scale's reciprocal (div_by_scale);
  // every code must equal the rule's (encode). Scales drawn like real ones
  // (amax / fmax over a wide range), quotients spread over both formats'
  // ranges down to below their smallest codes, a quarter placed on and next
  // to the codes' rounding midpoints, signs (and -0) mixed.
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> log_s(-82.f, 102.f), log_q(-24.f, 17.f), unit(0.f, 1.f);
  int checked = 0;
  for (int i = 0; i < 2000000; ++i) {
    const Format f = i % 2 ? Format::kE5M2 : Format::kE4M3;
    const float s = std::exp2(log_s(rng)) * (1.f + unit(rng));
    if (!fast_division_ok(s)) continue;
    float x = std::exp2(log_q(rng)) * s;
    if (i % 8 < 2) {  // a midpoint between two neighbouring codes, or next to it
      const int code = 1 + static_cast<int>(unit(rng) * (f == Format::kE4M3 ? 125 : 122));
      const float mid = 0.5f * (fp8_to_float(code, f) + fp8_to_float(code + 1, f));
      x = mid * s;
      if (i % 8 == 1) x = std::nextafter(x, (i & 16) ? INFINITY : 0.f);
    }
    if (i % 1000 == 3) x = 0.f;
    if (unit(rng) < 0.5f) x = -x;
    const uint8_t fast = float_to_fp8(div_by_scale(x, s, 1.0f / s), f), exact = encode(x, s, f);
    ASSERT_EQ(fast, exact) << x << " / " << s << (f == Format::kE4M3 ? " e4m3" : " e5m2");
    // Quotients below 2^17 are finite: the unguarded form of computed scales.
    ASSERT_EQ(float_to_fp8(div_by_bounded_scale(x, s, 1.0f / s), f), exact) << x << " / " << s;
    ++checked;
  }
  EXPECT_GT(checked, 1000000);
  EXPECT_FALSE(fast_division_ok(0x1p-81f));
  EXPECT_FALSE(fast_division_ok(INFINITY));
  EXPECT_FALSE(fast_division_ok(std::nanf("")));
}

TEST(ScaleRule, PowerOfTwoScalesDivideByOneMultiplication) {
  // pow2_division_ok scales: x * (1 / s) gives the rule's codes, quotients
  // from below the smallest codes to past the saturation (and inf), on and
  // next to rounding midpoints, -0 kept.
  std::mt19937 rng(12);
  std::uniform_int_distribution<int> log_s(-80, 100);
  std::uniform_real_distribution<float> log_q(-30.f, 40.f), unit(0.f, 1.f);
  for (int i = 0; i < 1000000; ++i) {
    const Format f = i % 2 ? Format::kE5M2 : Format::kE4M3;
    const float s = std::exp2(static_cast<float>(log_s(rng)));
    ASSERT_TRUE(pow2_division_ok(s)) << s;
    float x = std::exp2(log_q(rng)) * s;
    if (i % 8 < 2) {
      const int code = 1 + static_cast<int>(unit(rng) * (f == Format::kE4M3 ? 125 : 122));
      x = 0.5f * (fp8_to_float(code, f) + fp8_to_float(code + 1, f)) * s;
      if (i % 8 == 1) x = std::nextafter(x, (i & 16) ? INFINITY : 0.f);
    }
    if (i % 1000 == 3) x = 0.f;
    if (unit(rng) < 0.5f) x = -x;
    ASSERT_EQ(float_to_fp8(x * (1.0f / s), f), encode(x, s, f)) << x << " / " << s;
  }
  EXPECT_FALSE(pow2_division_ok(3.f));
  EXPECT_FALSE(pow2_division_ok(0x1p-81f));
  EXPECT_FALSE(pow2_division_ok(INFINITY));
}

TEST(CastCpu, BlockScalesPerTileAndTransposedCopy) {
  // 130 x 200: partial tiles in both directions; element (i, j) = i - j.
  const int64_t rows = 130, cols = 200;
  std::vector<float> x(rows * cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) x[i * cols + j] = static_cast<float>(i - j);
  std::vector<uint8_t> data(rows * cols), data_t(rows * cols);
  std::vector<float> scale(rows * 2), scale_t(cols * 2);
  float amax = 0.f;
  CastArgs a{};
  a.input = x.data();
  a.input_dtype = DType::kFloat32;
  a.rows = rows;
  a.cols = cols;
  a.scaling = Scaling::kBlock;
  a.format = Format::kE4M3;
  a.data = data.data();
  a.scale = scale.data();
  a.transpose = true;
  a.data_t = data_t.data();
  a.scale_t = scale_t.data();
  a.amax = &amax;
  cast_cpu(a);
  EXPECT_EQ(amax, 199.f);
  // row 0: tile 0 holds 0..-127 (amax 127), tile 1 -128..-199 (amax 199)
  EXPECT_EQ(scale[0], 127.f / 448.f);
  EXPECT_EQ(scale[1], 199.f / 448.f);
  // column 0 of the input is row 0 of data_t: tile 0 rows 0..127 (amax 127), tile 1 rows 128..129
  EXPECT_EQ(scale_t[0], 127.f / 448.f);
  EXPECT_EQ(scale_t[1], 129.f / 448.f);
  EXPECT_EQ(data[0], 0);
  EXPECT_EQ(data_t[1 * rows + 0], encode(-1.f, scale_t[2], Format::kE4M3));  // x[0][1] under column 1's tile
}

}  // namespace
