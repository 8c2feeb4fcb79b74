// CPU reference kernels for NVFP4 quantize / dequantize: straight loops over
// the rule in nvfp4_format.h, the ground truth the CUDA kernels must match.
#include "lowbit/format/float_convert.h"
#include "lowbit/format/nvfp4_format.h"
#include "lowbit/format/nvfp4_quant.h"

namespace lowbit::nvfp4 {
namespace {

float load_element(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kFloat16: return half_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kBFloat16: return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.f;
}

void store_element(void* base, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[i] = v; break;
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = float_to_half_bits(v); break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(v); break;
  }
}

}  // namespace

void quantize_cpu(const QuantizeArgs& a) {
  const int64_t group_elems = a.rows * a.cols;
  const int64_t blocks_per_row = a.cols / kBlockSize;
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t base = g * group_elems;
    float s;
    if (a.global_scale_in) {
      s = a.global_scale_in[g];
    } else {
      float amax = 0.f;
      for (int64_t i = 0; i < group_elems; ++i) amax = nan_propagating_absmax(amax, load_element(a.input, a.input_dtype, base + i));
      s = global_scale_from_amax(amax);
    }
    a.global_scale_out[g] = s;
    for (int64_t r = 0; r < a.rows; ++r) {
      for (int64_t b = 0; b < blocks_per_row; ++b) {
        const int64_t first = base + r * a.cols + b * kBlockSize;
        float x[kBlockSize];
        float block_amax = 0.f;
        for (int j = 0; j < kBlockSize; ++j) {
          x[j] = load_element(a.input, a.input_dtype, first + j);
          block_amax = nan_propagating_absmax(block_amax, x[j]);
        }
        const uint8_t scale = encode_block_scale(block_amax, s);
        a.block_scale[first / kBlockSize] = scale;
        const float d = s * e4m3_to_float(scale);
        const float r = reciprocal_rn(d);
        for (int j = 0; j < kBlockSize; j += 2) {
          a.packed[(first + j) / 2] =
              static_cast<uint8_t>(encode_element(x[j], d, r) | (encode_element(x[j + 1], d, r) << 4));
        }
      }
    }
  }
}

void dequantize_cpu(const DequantizeArgs& a) {
  const int64_t group_elems = a.rows * a.cols;
  for (int64_t g = 0; g < a.groups; ++g) {
    const float s = a.global_scale[g];
    for (int64_t i = g * group_elems; i < (g + 1) * group_elems; ++i) {
      const uint32_t code = (a.packed[i / 2] >> ((i & 1) * 4)) & 0xfu;
      const float b = e4m3_to_float(a.block_scale[i / kBlockSize]);
      store_element(a.output, a.output_dtype, i, decode_element(code, b, s));
    }
  }
}

}  // namespace lowbit::nvfp4
