// lowbit's own block-scaled FP8 GEMM for Hopper (DeepSeek-V3's scaling):
//   y [m, n] = sum over K-blocks kb of (A_kb B_kb^T) * sa[row, kb] * sb(col, kb)  (+ bias)
// A [m, k] and B [n, k] FP8 codes (row-major, K contiguous), sa the 1 x 128
// scales of A ([m, k/128]), sb either B's 128 x 128 scales
// ([ceil(n/128), k/128]: the forward and dgrad GEMMs) or its 1 x 128 scales
// given transposed ([k/128, n]: the wgrad GEMM, both operands scaled along
// the token dimension). Each K-block's partial product leaves the tensor
// cores' accumulator (about 14 significant bits for FP8 operands) and is
// added into FP32 registers with its scales: the promotion cuBLASLt does for
// the same scaling. docs/fp8.md, "What runs where".
#pragma once

#include "lowbit/common.h"
#include "lowbit/fp8/fp8_format.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace lowbit::fp8 {

struct BlockGemmArgs {
  const void* a;  // [m, k] codes, 16-byte aligned
  Format format_a;
  const void* b;  // [n, k] codes, 16-byte aligned
  Format format_b;
  int64_t m, n, k;
  const float* scale_a;  // [m, k/128]
  const float* scale_b;  // kBlock2d: [ceil(n/128), k/128]; kBlock: [k/128, n] (transposed), 16-byte aligned
  Scaling scaling_b;     // kBlock2d or kBlock
  const float* bias;     // [n] float32 (added before the output's one rounding), or null
  DType out_dtype;       // kBFloat16 or kFloat32
  void* out;             // [m, n]
};

// Whether block_gemm_cuda takes these operands (everything else stays on the
// caller's other paths): K a multiple of 128, n a multiple of 16, at most one
// E5M2 operand, a bfloat16 or float32 output, 16-byte aligned operands and
// transposed 1 x 128 scales, sizes within the kernel's 32-bit tile indices.
bool block_gemm_takes(const BlockGemmArgs& args);

#if defined(LOWBIT_WITH_CUDA)
cudaError_t block_gemm_cuda(const BlockGemmArgs& args, cudaStream_t stream);
#endif

}  // namespace lowbit::fp8
