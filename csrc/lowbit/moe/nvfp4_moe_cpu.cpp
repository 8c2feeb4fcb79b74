// CPU reference of the NVFP4 MoE (nvfp4_moe.h): each expert's prepacked
// weights dequantized with the Linear's unpack_cpu, then the experts' MLPs and
// the weighted combine in FP32 loops, the ground truth the CUDA kernels are
// checked against.
#include "lowbit/format/float_convert.h"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "lowbit/moe/nvfp4_moe.h"

#include <cmath>
#include <vector>

namespace lowbit::nvfp4::moe {
namespace {

float load(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kFloat16: return half_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16: return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.0f;
}

void store(void* p, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(p)[i] = v; break;
    case DType::kFloat16: static_cast<uint16_t*>(p)[i] = float_to_half_bits(v); break;
    case DType::kBFloat16: static_cast<uint16_t*>(p)[i] = float_to_bf16_bits(v); break;
  }
}

// v rounded to dtype and back.
float round_to(DType dtype, float v) {
  switch (dtype) {
    case DType::kFloat32: return v;
    case DType::kFloat16: return half_bits_to_float(float_to_half_bits(v));
    case DType::kBFloat16: return bf16_bits_to_float(float_to_bf16_bits(v));
  }
  return v;
}

// min(v, hi) and clamp(v, lo, hi) that keep a NaN.
float clamp_max(float v, float hi) { return v > hi ? hi : v; }
float clamp(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Expert e of a stacked prepacked weight [E, N, Kp/2], dequantized to FP32
// [N, K] (rows as prepacked).
void dequantize_expert(const uint8_t* w, const uint8_t* s, const float* g, int64_t e, int64_t n, int64_t k,
                       std::vector<float>& out) {
  const int64_t kp = gemm::padded_k(k);
  out.resize(static_cast<size_t>(n * k));
  gemm::UnpackArgs a{};
  a.weight = w + e * n * (kp / 2);
  a.scale = s + e * n * (kp / 16);
  a.global_scale = g + e;
  a.n = n;
  a.k = k;
  a.out = out.data();
  a.out_dtype = DType::kFloat32;
  gemm::unpack_cpu(a);
}

float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

}  // namespace

void moe_cpu(const MoeArgs& a) {
  const int64_t h = a.h, inter = a.inter;
  std::vector<float> acc(static_cast<size_t>(a.m * h), 0.0f);
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(a.e));  // flat slot indices per expert, in slot order
  for (int64_t i = 0; i < a.m * a.k; ++i) slots[a.topk_ids[i]].push_back(i);
  std::vector<float> w13, w2, xt(static_cast<size_t>(h)), act(static_cast<size_t>(inter));
  for (int64_t e = 0; e < a.e; ++e) {
    if (slots[e].empty()) continue;
    dequantize_expert(a.w13, a.w13_scale, a.w13_global, e, 2 * inter, h, w13);
    dequantize_expert(a.w2, a.w2_scale, a.w2_global, e, h, inter, w2);
    for (const int64_t slot : slots[e]) {
      const int64_t t = slot / a.k;
      for (int64_t c = 0; c < h; ++c) xt[c] = load(a.x, a.dtype, t * h + c);
      for (int64_t j = 0; j < inter; ++j) {
        // W13's prepacked row order: per 16 rows, 8 gate rows then the 8 up
        // rows of the same intermediate columns (interleave_w13, csrc/torch/moe_ops.cpp).
        const int64_t row = j / 8 * 16 + j % 8;
        float gate = dot(xt.data(), &w13[row * h], h);
        float up = dot(xt.data(), &w13[(row + 8) * h], h);
        if (a.has_limit) {
          gate = clamp_max(gate, a.swiglu_limit);
          up = clamp(up, -a.swiglu_limit, a.swiglu_limit);
        }
        const float silu = gate / (1.0f + std::exp(-gate));
        act[j] = round_to(a.dtype, silu * up);
      }
      const float weight = a.topk_weights[slot];
      for (int64_t c = 0; c < h; ++c) acc[t * h + c] += dot(act.data(), &w2[c * inter], inter) * weight;
    }
  }
  for (int64_t i = 0; i < a.m * h; ++i) store(a.out, a.dtype, i, acc[i]);
}

}  // namespace lowbit::nvfp4::moe
