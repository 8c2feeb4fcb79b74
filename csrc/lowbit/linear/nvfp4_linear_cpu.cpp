// CPU reference of the NVFP4 Linear layout: prepack, unpack (to dequantized
// values) and unprepack (back to the checkpoint layout). The CPU Linear is
// unpack + an FP32 matmul in the binding.
#include "lowbit/format/float_convert.h"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"

#include <cstring>

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

}  // namespace lowbit::nvfp4::gemm
