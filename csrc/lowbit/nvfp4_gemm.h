// NVFP4 Linear (W4A16): y = x W^T * global (+ bias), with W in the prepacked
// layout of nvfp4_gemm_layout.h. Argument structs and the CPU / CUDA entry
// points; arguments are validated by the caller (csrc/torch).
#pragma once

#include "lowbit/common.h"

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
  uint8_t* scale;              // [N, Kp/16]
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

// Small-M fused GEMM (CUDA only): out [M, N] = x [M, K] W^T * global + bias.
struct LinearArgs {
  const void* x;               // [M, K] contiguous, 16-byte aligned, dtype
  DType dtype;                 // kBFloat16 or kFloat16
  const uint8_t* weight;       // prepacked [N, Kp/2], 16-byte aligned
  const uint8_t* scale;        // prepacked [N, Kp/16], 16-byte aligned
  const float* global_scale;   // []
  const void* bias;            // [N] dtype, or null
  void* out;                   // [M, N] dtype
  int64_t m, n, k;
  float* workspace;            // [splits, M, N] when splits > 1
};

void prepack_cpu(const PrepackArgs& args);
void unpack_cpu(const UnpackArgs& args);

#if defined(LOWBIT_WITH_CUDA)
cudaError_t prepack_cuda(const PrepackArgs& args, cudaStream_t stream);
cudaError_t unpack_cuda(const UnpackArgs& args, cudaStream_t stream);

// Largest M the fused small-M kernel takes; larger M goes through unpack +
// cuBLAS in the binding (measured faster from M = 64 on, docs/PERF.md).
constexpr int64_t kFusedMaxM = 32;
// Split-K factor the fused kernel uses for this problem (workspace floats =
// splits * m * n when it is > 1).
int64_t fused_splits(int64_t m, int64_t n, int64_t k);
cudaError_t linear_fused_cuda(const LinearArgs& args, int64_t splits, cudaStream_t stream);
#endif

}  // namespace lowbit::nvfp4::gemm
