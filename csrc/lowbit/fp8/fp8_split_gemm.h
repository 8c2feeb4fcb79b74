// lowbit's row-scaled FP8 GEMM for outputs of few tiles, K split across the
// CTAs of a cluster:
//   y [m, n] = (sum over k of a[m, k] b[n, k]) * scale_a[m] * scale_b[n] (+ bias[n])
// A [m, k] and B [n, k] E4M3 codes (row-major, K contiguous), one FP32 scale
// per row of each, y rounded once to BF16 or FP16.
//
// Why: a Linear's FP8 path at 128-1024 rows on a narrow weight (4096 x 1536
// at 256 rows: 16 output tiles) leaves most SMs idle in cuBLASLt's
// row-scaled GEMM. Here each output tile is one cluster of S CTAs (S =
// split_gemm_splits, up to 8); CTA r sums the r-th share of K's 128-wide
// blocks, the S FP32 partial tiles are added through distributed shared
// memory in rank order (deterministic), and the scales and bias are applied
// to the sum. No workspace, no counters, nothing to zero between calls.
// The tensor cores' accumulator is added into FP32 registers after every
// 128-wide K-block, or with fast_accum after every four (512 products;
// cuBLASLt's fast accumulation sums all of K there).
#pragma once

#include "lowbit/common.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace lowbit::fp8 {

struct SplitGemmArgs {
  const void* a;  // [m, k] E4M3 codes, 16-byte aligned
  const void* b;  // [n, k] E4M3 codes, 16-byte aligned
  int64_t m, n, k;
  const float* scale_a;  // [m]
  const float* scale_b;  // [n], 16-byte aligned
  const void* bias;      // [n] of out_dtype, or null
  DType out_dtype;       // kBFloat16 or kFloat16
  bool fast_accum;       // promote every 512 products instead of every 128
  void* out;             // [m, n], 16-byte aligned (checked at launch)
};

// Whether split_gemm_cuda takes these operands: k and n multiples of 16
// (the codes' rows for the tensor copies; the epilogue's 4-column groups),
// a BF16 or FP16 output, aligned inputs, sizes below 2^30.
bool split_gemm_takes(const SplitGemmArgs& args);

#if defined(LOWBIT_WITH_CUDA)
// The CTAs per output tile (K splits, 1-8) split_gemm_cuda would run on the
// current device: as many as fill its SMs once with every tile's cluster
// resident, each summing at least four 128-wide K-blocks; 0 if it does not
// take the arguments. Host-side arithmetic on cached device properties (no
// sync).
int split_gemm_splits(const SplitGemmArgs& args);

// Runs the GEMM with `splits` CTAs per tile (split_gemm_splits' answer,
// which the caller has already asked for to decide whether to run it).
cudaError_t split_gemm_cuda(const SplitGemmArgs& args, int splits, cudaStream_t stream);
#endif

}  // namespace lowbit::fp8
