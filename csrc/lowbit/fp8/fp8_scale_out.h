// The row-scaled FP8 GEMM as a unit-scale GEMM and a scaling pass:
//   acc [m, n] = a b^T in FP32 (cuBLASLt's per-tensor FP8 GEMM, both scales 1)
//   y [m, n]   = acc * scale_a[m] * scale_b[n] (+ bias[n]), rounded once
// The same sum and the same scales as a row-scaled GEMM, applied after the
// GEMM instead of in its epilogue. Why: on outputs of up to about a million
// elements cuBLASLt's per-tensor FP8 GEMM ran 1.3-2.1x faster than its
// row-scaled one on the same codes (H200, docs/perf/log/linear.md, "Linear
// v38"), more than the FP32 round trip through memory costs.
#pragma once

#include "lowbit/common.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace lowbit::fp8 {

struct ScaleOutArgs {
  const float* acc;      // [m, n] FP32, 16-byte aligned
  int64_t m, n;          // n % 4 == 0
  const float* scale_a;  // [m]
  const float* scale_b;  // [n]
  const void* bias;      // [n] of out_dtype, or null
  DType out_dtype;       // kBFloat16 or kFloat16
  void* out;             // [m, n], 8-byte aligned
};

#if defined(LOWBIT_WITH_CUDA)
// y from acc (above) on `stream`; cudaErrorInvalidValue for arguments it
// does not take (n % 4 != 0, misaligned pointers, another dtype).
cudaError_t scale_out_cuda(const ScaleOutArgs& args, cudaStream_t stream);

// A float 1.0 in device memory of the current device (a __device__
// constant of this library, valid from module load, so also inside CUDA
// graphs and before any kernel ran): the per-tensor GEMM's two scales.
cudaError_t unit_scale_cuda(const float** ptr);
#endif

}  // namespace lowbit::fp8
