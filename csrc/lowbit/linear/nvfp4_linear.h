// NVFP4 Linear (W4A16): y = x W^T * global (+ bias), with W in the prepacked
// layout of nvfp4_linear_layout.h. Argument structs and the CPU / CUDA entry
// points; arguments are validated by the caller (csrc/torch).
#pragma once

#include "lowbit/common.h"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "lowbit/linear/sm90_linear_plan.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace lowbit::nvfp4::gemm {

// Checkpoint layout -> prepacked layout.
struct PrepackArgs {
  const uint8_t* codes;        // [N, K/2]
  const uint8_t* block_scale;  // [N, K/16] E4M3 codes
  int64_t n, k;                // n % 16 == 0, k % 16 == 0
  uint8_t* weight;             // [N, Kp/2]
  uint8_t* scale;              // [N, Kp/16] written (the tensor's trailing bytes are the binding's)
};

// Prepacked layout -> dequantized [N, K] (e2m1 * block scale * global).
struct UnpackArgs {
  const uint8_t* weight;       // [N, Kp/2]
  const uint8_t* scale;        // [N, Kp/16]
  const float* global_scale;   // [] (device pointer on CUDA)
  int64_t n, k;
  void* out;                   // [N, K] out_dtype
  DType out_dtype;
};

// Prepacked layout -> checkpoint layout, the inverse of prepack (host
// only: a save-time conversion). Exact for positive finite block scales, all
// a quantizer writes; the prepacked form has already folded the others into
// its codes, which come back as the same values: a zero scale as scale 1.0
// with zero codes, a negative one as its magnitude with the codes' signs
// flipped, a NaN one (sign dropped) as E4M3 NaN 0x7F.
struct UnprepackArgs {
  const uint8_t* weight;       // [N, Kp/2]
  const uint8_t* scale;        // [N, Kp/16]
  int64_t n, k;
  uint8_t* codes;              // [N, K/2]
  uint8_t* block_scale;        // [N, K/16] E4M3 codes
};

// Fused GEMMs (CUDA only): out [M, N] = x [M, K] W^T * global + bias.
struct LinearArgs {
  const void* x;               // [M, K] contiguous, 16-byte aligned, dtype
  DType dtype;                 // kBFloat16 or kFloat16
  const uint8_t* weight;       // prepacked [N, Kp/2], 16-byte aligned
  const uint8_t* scale;        // prepacked [N, Kp/16], 16-byte aligned
  const float* global_scale;   // []
  const void* bias;            // [N] dtype, or null
  void* out;                   // [M, N] dtype
  int64_t m, n, k;
  void* workspace;             // LinearPlan::workspace_bytes, 256-byte aligned (null when 0)
};

// The FP8 path of the Linear (W4A8 on FP8 tensor cores): W and x rounded to
// E4M3 with one FP32 scale per row, then an FP8 GEMM with FP32 sums (the
// caller's: cuBLASLt through at::_scaled_mm). The one rounding rule, per
// row of values v (a W row: e2m1 * block scale, exact in FP32, the global
// scale left out; an x row: x), in FP32 with one rounding per operation:
//   amax = the largest |v| among the row's values that are not NaN (0 if
//          none): fp8_absmax,
//   r = 448 / amax, 0 when amax is 0: fp8_row_reciprocal,
//   code = e4m3(v * r), round to nearest even, saturating at +-448 (the
//          product exceeds 448 by at most a rounding, which rounds to 448);
//          NaN becomes E4M3 NaN 0x7F, zeros keep their sign (float_to_e4m3),
//   row scale = amax * global / 448 for W, amax * 1 / 448 for x:
//          fp8_row_scale;
// y = (sum of code products) * x row scale * W row scale (+ bias), rounded
// once to x's dtype. The W rows are made once per weight (fp8_weight_*,
// lowbit::nvfp4_to_fp8, at load time) or on every call (the op's FP8 mode
// without a cached weight); x rows on every call (fp8_rows_*). The CPU
// loops (nvfp4_linear_cpu.cpp) are the rule's reference; the CUDA kernels
// (nvfp4_linear_fp8.cu) compute the same codes and scales bit for bit.
constexpr float kE4m3Max = 448.f;  // the largest finite E4M3 value

// max(running, |v|) ignoring a NaN v (IEEE maxNum, as fmaxf and the
// kernels' half-precision max): a NaN element codes as NaN by itself and
// leaves the other elements' scale alone. running >= 0.
LOWBIT_HD float fp8_absmax(float running, float v) {
  const float a = v < 0.f ? -v : v;
  return a > running ? a : running;  // false for NaN: running kept
}
LOWBIT_HD float fp8_row_reciprocal(float amax) { return amax > 0.f ? kE4m3Max / amax : 0.f; }
LOWBIT_HD float fp8_row_scale(float amax, float global) { return amax * global / kE4m3Max; }

struct Fp8WeightArgs {
  const uint8_t* weight;       // prepacked [N, Kp/2]
  const uint8_t* scale;        // prepacked [N, Kp/16]
  const float* global_scale;   // [] (device pointer on CUDA)
  int64_t n, k;
  uint8_t* out;                // [N, K] E4M3
  float* row_scale;            // [N]
  float* row_amax;             // [N] scratch (CUDA; unused on the CPU)
};
struct Fp8RowsArgs {
  const void* x;               // [M, K] contiguous, 16-byte aligned, dtype
  DType dtype;                 // kBFloat16, kFloat16 or kFloat32
  int64_t m, k;                // k % 16 == 0
  uint8_t* out;                // [M, K] E4M3
  float* row_scale;            // [M]
};

void prepack_cpu(const PrepackArgs& args);
void unpack_cpu(const UnpackArgs& args);
void unprepack_cpu(const UnprepackArgs& args);
void fp8_weight_cpu(const Fp8WeightArgs& args);
void fp8_rows_cpu(const Fp8RowsArgs& args);

#if defined(LOWBIT_WITH_CUDA)
cudaError_t prepack_cuda(const PrepackArgs& args, cudaStream_t stream);
cudaError_t unpack_cuda(const UnpackArgs& args, cudaStream_t stream);
cudaError_t fp8_weight_cuda(const Fp8WeightArgs& args, cudaStream_t stream);
cudaError_t fp8_rows_cuda(const Fp8RowsArgs& args, cudaStream_t stream);

// The fused GEMM runs the plan linear_plan picks for the shape and the
// device; sm90_linear_plan.h describes which kernel form runs where.
cudaError_t linear_fused_cuda(const LinearArgs& args, const LinearPlan& plan, cudaStream_t stream);

// The wgmma form alone (sm90_linear_wgmma.cu), for plans of LinearPath::kWgmma.
cudaError_t linear_wgmma_cuda(const LinearArgs& args, const LinearPlan& plan, cudaStream_t stream);
// The grouped (block-diagonal) Linear on the wgmma kernel: x [M, G, K]
// (args.x, row stride G K), W [G group_n, K] prepacked (args.n = G group_n),
// out [M, G, group_n]: out[m, g] = x[m, g] W_g^T * global (+ bias), W_g rows
// [g group_n, (g + 1) group_n). group_n a multiple of kWgmmaBlockRows and K of 128
// (else cudaErrorInvalidValue): a W block lies in one group and a group's
// columns of x end on a k-tile.
cudaError_t grouped_linear_wgmma_cuda(const LinearArgs& args, int64_t group_n, cudaStream_t stream);
#endif

}  // namespace lowbit::nvfp4::gemm
