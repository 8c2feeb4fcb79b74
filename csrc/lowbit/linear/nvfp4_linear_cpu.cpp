// CPU reference of the NVFP4 Linear layout: prepack, unpack (to dequantized
// values) and unprepack (back to the checkpoint layout); and the reference
// of the FP8 path's rounding rule (nvfp4_linear.h): W rows and x rows to
// E4M3 with a scale per row. The CPU Linear is unpack (or these roundings)
// + an FP32 matmul in the binding.
#include "lowbit/format/float_convert.h"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"

#include <cstring>
#include <vector>

namespace lowbit::nvfp4::gemm {

void prepack_cpu(const PrepackArgs& a) {
  const int64_t kp = padded_k(a.k);
  std::memset(a.weight, 0, static_cast<size_t>(a.n * kp / 2));
  const uint8_t one = encode_scale(0x38).byte;  // E4M3 1.0, for padding blocks
  std::memset(a.scale, one, static_cast<size_t>(a.n * kp / 16));
  for (int64_t n = 0; n < a.n; ++n) {
    for (int64_t b = 0; b < a.k / 16; ++b) {
      const ScaleCode s = encode_scale(a.block_scale[n * (a.k / 16) + b]);
      a.scale[element_pos(n, b * 16, kp).scale_byte] = s.byte;
      for (int64_t k = b * 16; k < b * 16 + 16; ++k) {
        uint32_t code = (a.codes[n * (a.k / 2) + k / 2] >> (4 * (k & 1))) & 0xfu;
        if (s.zero) code = 0;
        if (s.negative) code ^= 8u;
        const ElementPos p = element_pos(n, k, kp);
        uint32_t word;
        std::memcpy(&word, a.weight + p.word_byte, 4);
        word |= ((code & 7u) << p.slot.mag) | ((code >> 3) << p.slot.sign);
        std::memcpy(a.weight + p.word_byte, &word, 4);
      }
    }
  }
}

void unpack_cpu(const UnpackArgs& a) {
  const int64_t kp = padded_k(a.k);
  const float global = *a.global_scale;
  for (int64_t n = 0; n < a.n; ++n) {
    for (int64_t k = 0; k < a.k; ++k) {
      const ElementPos p = element_pos(n, k, kp);
      uint32_t word;
      std::memcpy(&word, a.weight + p.word_byte, 4);
      const uint32_t code = ((word >> p.slot.mag) & 7u) | (((word >> p.slot.sign) & 1u) << 3);
      const float v = decode_element(code, decode_scale(a.scale[p.scale_byte]), global);
      const int64_t i = n * a.k + k;
      switch (a.out_dtype) {
        case DType::kFloat32: static_cast<float*>(a.out)[i] = v; break;
        case DType::kFloat16: static_cast<uint16_t*>(a.out)[i] = float_to_half_bits(v); break;
        case DType::kBFloat16: static_cast<uint16_t*>(a.out)[i] = float_to_bf16_bits(v); break;
      }
    }
  }
}

void unprepack_cpu(const UnprepackArgs& a) {
  const int64_t kp = padded_k(a.k);
  std::memset(a.codes, 0, static_cast<size_t>(a.n * a.k / 2));
  for (int64_t n = 0; n < a.n; ++n) {
    for (int64_t b = 0; b < a.k / 16; ++b) {
      // decode_scale gives the exact E4M3 value (or NaN), which re-encodes exactly.
      const float scale = decode_scale(a.scale[element_pos(n, b * 16, kp).scale_byte]);
      a.block_scale[n * (a.k / 16) + b] = float_to_e4m3(scale);
      for (int64_t k = b * 16; k < b * 16 + 16; ++k) {
        const ElementPos p = element_pos(n, k, kp);
        uint32_t word;
        std::memcpy(&word, a.weight + p.word_byte, 4);
        const uint32_t code = ((word >> p.slot.mag) & 7u) | (((word >> p.slot.sign) & 1u) << 3);
        a.codes[n * (a.k / 2) + k / 2] |= static_cast<uint8_t>(code << (4 * (k & 1)));
      }
    }
  }
}

void fp8_weight_cpu(const Fp8WeightArgs& a) {
  const int64_t kp = padded_k(a.k);
  const float global = *a.global_scale;
  std::vector<float> v(static_cast<size_t>(a.k));
  for (int64_t n = 0; n < a.n; ++n) {
    float amax = 0.f;
    for (int64_t k = 0; k < a.k; ++k) {
      const ElementPos p = element_pos(n, k, kp);
      uint32_t word;
      std::memcpy(&word, a.weight + p.word_byte, 4);
      const uint32_t code = ((word >> p.slot.mag) & 7u) | (((word >> p.slot.sign) & 1u) << 3);
      v[k] = decode_element(code, decode_scale(a.scale[p.scale_byte]), 1.f);  // exact: the global left out
      amax = fp8_absmax(amax, v[k]);
    }
    const float r = fp8_row_reciprocal(amax);
    for (int64_t k = 0; k < a.k; ++k) a.out[n * a.k + k] = float_to_e4m3(v[k] * r);
    a.row_scale[n] = fp8_row_scale(amax, global);
  }
}

void fp8_rows_cpu(const Fp8RowsArgs& a) {
  std::vector<float> v(static_cast<size_t>(a.k));
  for (int64_t m = 0; m < a.m; ++m) {
    float amax = 0.f;
    for (int64_t k = 0; k < a.k; ++k) {
      const int64_t i = m * a.k + k;
      switch (a.dtype) {
        case DType::kFloat32: v[k] = static_cast<const float*>(a.x)[i]; break;
        case DType::kFloat16: v[k] = half_bits_to_float(static_cast<const uint16_t*>(a.x)[i]); break;
        case DType::kBFloat16: v[k] = bf16_bits_to_float(static_cast<const uint16_t*>(a.x)[i]); break;
      }
      amax = fp8_absmax(amax, v[k]);
    }
    const float r = fp8_row_reciprocal(amax);
    for (int64_t k = 0; k < a.k; ++k) a.out[m * a.k + k] = float_to_e4m3(v[k] * r);
    a.row_scale[m] = fp8_row_scale(amax, 1.f);
  }
}

}  // namespace lowbit::nvfp4::gemm
