// Exhaustive tests of the NVFP4 codecs (all 16 E2M1 codes, all 256 E4M3
// codes), rounding ties, saturation, the NaN/inf policy and the quantization
// rule of nvfp4_format.h, plus the CPU quantize/dequantize kernels.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "lowbit/format/float_convert.h"
#include "lowbit/format/nvfp4_format.h"
#include "lowbit/format/nvfp4_quant.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_fp8.h>
#endif

using namespace lowbit;
using namespace lowbit::nvfp4;

namespace {

const float kE2M1Magnitudes[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

// E4M3 value by the format's definition, computed with ldexp.
float e4m3_by_definition(int code) {
  int sign = code >> 7, exp = (code >> 3) & 15, mant = code & 7;
  if (exp == 15 && mant == 7) return std::numeric_limits<float>::quiet_NaN();
  float mag = exp == 0 ? std::ldexp(mant / 8.0f, -6) : std::ldexp(1.0f + mant / 8.0f, exp - 7);
  return sign ? -mag : mag;
}

}  // namespace

TEST(E2M1, DecodesAllSixteenCodes) {
  for (int c = 0; c < 16; ++c) {
    float expected = (c & 8) ? -kE2M1Magnitudes[c & 7] : kE2M1Magnitudes[c & 7];
    EXPECT_EQ(e2m1_to_float(c), expected) << "code " << c;
    EXPECT_EQ(std::signbit(e2m1_to_float(c)), (c & 8) != 0) << "code " << c;
  }
}

TEST(E2M1, EncodeInvertsDecodeIncludingNegativeZero) {
  for (int c = 0; c < 16; ++c) EXPECT_EQ(float_to_e2m1(e2m1_to_float(c)), c) << "code " << c;
}

TEST(E2M1, TiesGoToTheEvenCode) {
  // midpoint -> expected code (even of the two neighbours)
  const std::pair<float, int> ties[] = {{0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4},
                                        {2.5f, 4},  {3.5f, 6},  {5.0f, 6}};
  for (auto [x, code] : ties) {
    EXPECT_EQ(float_to_e2m1(x), code) << x;
    EXPECT_EQ(float_to_e2m1(-x), code | 8) << -x;
  }
}

TEST(E2M1, RoundsToNearestAwayFromTies) {
  for (int m = 0; m < 7; ++m) {
    float lo = kE2M1Magnitudes[m], hi = kE2M1Magnitudes[m + 1], mid = 0.5f * (lo + hi);
    EXPECT_EQ(float_to_e2m1(std::nextafter(mid, lo)), m) << mid;
    EXPECT_EQ(float_to_e2m1(std::nextafter(mid, hi)), m + 1) << mid;
  }
}

TEST(E2M1, SaturatesAndMapsNaNToZero) {
  EXPECT_EQ(float_to_e2m1(6.0f), 7);
  EXPECT_EQ(float_to_e2m1(7.5f), 7);
  EXPECT_EQ(float_to_e2m1(INFINITY), 7);
  EXPECT_EQ(float_to_e2m1(-INFINITY), 15);
  EXPECT_EQ(float_to_e2m1(std::nanf("")), 0);
  EXPECT_EQ(float_to_e2m1(-1e-30f), 8);  // sign kept when rounding to zero
}

TEST(E4M3, DecodesAllCodesByDefinition) {
  for (int c = 0; c < 256; ++c) {
    float got = e4m3_to_float(c), want = e4m3_by_definition(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
    } else {
      EXPECT_EQ(got, want) << "code " << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;
    }
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), 0.001953125f);
}

TEST(E4M3, EncodeInvertsDecodeOnEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(c)), c) << "code " << c;
  }
}

TEST(E4M3, TiesBetweenNeighbouringCodesGoToEven) {
  for (int c = 0; c < 0x7e; ++c) {
    float lo = e4m3_to_float(c), hi = e4m3_to_float(c + 1), mid = 0.5f * (lo + hi);
    int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(float_to_e4m3(mid), even) << "between codes " << c << " and " << c + 1;
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, lo)), c);
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, hi)), c + 1);
  }
}

TEST(E4M3, SaturatesFiniteAndInfiniteAndKeepsNaN) {
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(463.9f), 0x7e);
  EXPECT_EQ(float_to_e4m3(1e9f), 0x7e);
  EXPECT_EQ(float_to_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(float_to_e4m3(-INFINITY), 0xfe);
  EXPECT_EQ(float_to_e4m3(std::nanf("")), kE4M3NaN);
  EXPECT_EQ(float_to_e4m3(-std::nanf("")), kE4M3NaN);
  EXPECT_EQ(float_to_e4m3(1e-30f), 0x00);  // underflow to +0
}

#if defined(LOWBIT_WITH_CUDA)
// The CUDA toolkit's own conversion (host code in cuda_fp8.h) is an
// independent oracle for rounding on arbitrary floats.
TEST(E4M3, MatchesCudaToolkitConversionOnRandomFloats) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> exponent(-14.f, 9.5f);
  std::uniform_int_distribution<int> sign(0, 1);
  for (int i = 0; i < 200000; ++i) {
    float x = std::exp2(exponent(rng)) * (sign(rng) ? -1.f : 1.f);
    auto want = static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
    ASSERT_EQ(float_to_e4m3(x), want) << x;
  }
}
#endif

TEST(HalfFloat, RoundTripsAllFiniteHalves) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;  // NaN
    ASSERT_EQ(float_to_half_bits(half_bits_to_float(h)), h) << h;
  }
  EXPECT_EQ(float_to_half_bits(65520.0f), 0x7c00);         // rounds to inf
  EXPECT_EQ(float_to_half_bits(65519.0f), 0x7bff);         // rounds to max
  EXPECT_EQ(float_to_half_bits(2.98023224e-08f), 0x0000);  // 2^-25 tie -> even (0)
}

TEST(BFloat16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(bits_float(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(float_to_bf16_bits(bits_float(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(bf16_bits_to_float(0x4040), 3.0f);
}

TEST(QuantizeRule, BlockScaleAndElementsOfAKnownBlock) {
  // block amax 6 with s = 1/448: ratio 6/6*448 = 448 -> scale 0x7e
  const float s = 1.0f / 448.0f;
  EXPECT_EQ(encode_block_scale(6.0f, s), 0x7e);
  const float d = s * e4m3_to_float(0x7e);  // == 1 up to rounding
  const float r = reciprocal_rn(d);
  EXPECT_EQ(encode_element(6.0f, d, r), 7);
  EXPECT_EQ(encode_element(-3.0f, d, r), 13);
  EXPECT_EQ(encode_element(-0.0f, d, r), 8);
  EXPECT_EQ(encode_element(0.0f, d, r), 0);
}

TEST(QuantizeRule, DegenerateAndNonFiniteScales) {
  EXPECT_EQ(encode_block_scale(0.0f, 0.0f), float_to_e4m3(kE4M3MinNormal));  // all-zero tensor
  EXPECT_EQ(encode_block_scale(1e-20f, 1.0f), float_to_e4m3(kE4M3MinNormal));  // clamps up to 2^-6
  EXPECT_EQ(encode_block_scale(1e20f, 1.0f), 0x7e);                           // clamps down to 448
  EXPECT_EQ(encode_block_scale(std::nanf(""), 1.0f), kE4M3NaN);               // NaN block
  EXPECT_EQ(encode_block_scale(1.0f, INFINITY), float_to_e4m3(kE4M3MinNormal));
  EXPECT_EQ(encode_element(INFINITY, 1.0f, 1.0f), 7);                         // saturates
  EXPECT_EQ(encode_element(std::nanf(""), 1.0f, 1.0f), 0);
  EXPECT_EQ(encode_element(-std::nanf(""), 1.0f, 1.0f), 8);                   // NaN: magnitude 0, sign kept
  EXPECT_EQ(encode_element(-1.0f, INFINITY, 0.0f), 8);                        // -0
  EXPECT_EQ(encode_element(-0.0f, 0.0f, INFINITY), 8);                        // 0/0 keeps the sign of x
  EXPECT_EQ(encode_element(2.0f, 0.0f, INFINITY), 7);                         // x/0 saturates
  EXPECT_TRUE(std::isnan(nan_propagating_absmax(nan_propagating_absmax(0.f, std::nanf("")), 5.f)));
}

TEST(QuantizeRule, ReciprocalDivisionIsCorrectlyRounded) {
  // Quotients spread over and around the E2M1 range, with divisors drawn
  // like real scales (global * e4m3), plus quotients placed on and next to
  // every rounding midpoint.
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> log_d(-108.f, 108.f), log_q(-30.f, 4.f), unit(0.f, 1.f);
  const float mids[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f};
  for (int i = 0; i < 2000000; ++i) {
    const float d = std::exp2(log_d(rng)) * e4m3_to_float(8 + static_cast<int>(unit(rng) * 118));
    if (!reciprocal_division_ok(d)) continue;
    float x = std::exp2(log_q(rng)) * d;
    if (i % 4 == 0) x = mids[i % 8] * d;
    if (i % 4 == 1) x = std::nextafter(mids[i % 8] * d, (i & 8) ? INFINITY : 0.f);
    if (unit(rng) < 0.5f) x = -x;
    const float fast = div_with_reciprocal(x, d, reciprocal_rn(d)), exact = x / d;
    if (std::fabs(exact) >= 0.125f) {
      ASSERT_EQ(float_bits(fast), float_bits(exact)) << x << " / " << d;
    } else {
      ASSERT_EQ(float_to_e2m1(fast), float_to_e2m1(exact)) << x << " / " << d;  // both below the first threshold
    }
  }
}

namespace {

std::vector<float> quantize_roundtrip(const std::vector<float>& x, int64_t rows, int64_t cols, float* global) {
  std::vector<uint8_t> packed(x.size() / 2), scales(x.size() / 16);
  QuantizeArgs q{x.data(), DType::kFloat32, 1, rows, cols, nullptr, packed.data(), scales.data(), global, nullptr};
  quantize_cpu(q);
  std::vector<float> y(x.size());
  DequantizeArgs d{packed.data(), scales.data(), global, 1, rows, cols, y.data(), DType::kFloat32};
  dequantize_cpu(d);
  return y;
}

}  // namespace

TEST(CpuKernels, RoundTripErrorIsWithinFormatPrecision) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t rows = 64, cols = 256;
  std::vector<float> x(rows * cols);
  for (auto& v : x) v = normal(rng);
  float global = 0.f;
  auto y = quantize_roundtrip(x, rows, cols, &global);
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += double(y[i] - x[i]) * (y[i] - x[i]);
    den += double(x[i]) * x[i];
  }
  // E2M1 has a 1-bit mantissa: relative RMS error of Gaussian data is ~0.1.
  EXPECT_LT(std::sqrt(num / den), 0.15);
  EXPECT_GT(global, 0.f);
}

TEST(CpuKernels, AllZeroAndNonFiniteTensors) {
  const int64_t rows = 2, cols = 32;
  float global = -1.f;
  std::vector<float> zeros(rows * cols, 0.f);
  zeros[3] = -0.0f;
  auto y = quantize_roundtrip(zeros, rows, cols, &global);
  EXPECT_EQ(global, 0.f);
  for (float v : y) EXPECT_EQ(v, 0.f);
  EXPECT_TRUE(std::signbit(y[3]));

  std::vector<float> with_inf(rows * cols, 1.0f);
  with_inf[5] = INFINITY;
  y = quantize_roundtrip(with_inf, rows, cols, &global);
  EXPECT_TRUE(std::isinf(global));
  for (float v : y) EXPECT_TRUE(std::isnan(v));

  std::vector<float> with_nan(rows * cols, 1.0f);
  with_nan[40] = std::nanf("");
  y = quantize_roundtrip(with_nan, rows, cols, &global);
  EXPECT_TRUE(std::isnan(global));
  for (float v : y) EXPECT_TRUE(std::isnan(v));
}
