// General row-wise top-k: for each row of a [rows, cols] matrix, the k
// largest values in descending order and their column indices (int32).
// Equal values go to the lower index; NaN ranks above +inf (as torch.topk);
// -0.0 and +0.0 are equal. Values are returned bit for bit as stored.
//
// The CUDA path runs in two stages: each CTA selects the top-k of one chunk
// of a row into a workspace (candidates kept in index order), then one CTA
// per row selects from the candidates and sorts. Selection inside a CTA is
// a radix select on order-preserving 32-bit keys.
#pragma once

#include "lowbit/common.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace lowbit::topk {

constexpr int64_t kMaxCols = 131072;
constexpr int32_t kMaxK = 2048;
constexpr int64_t kChunk = 4096;  // columns per stage-1 CTA

// Order-preserving key: a larger key is a larger value; NaN maps above +inf,
// -0.0 onto +0.0.
LOWBIT_HD uint32_t order_key(float x) {
  uint32_t u = float_bits(x);
  if (x != x) return 0xffffffffu;
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct TopkArgs {
  const void* input;  // [rows, cols] contiguous, input_dtype (float32 or bfloat16)
  DType input_dtype;
  int64_t rows, cols;
  int32_t k;          // 1 <= k <= min(cols, kMaxK)
  void* values;       // [rows, k] input_dtype
  int32_t* indices;   // [rows, k]
  uint32_t* workspace;  // CUDA: topk_workspace_words(args) 32-bit words
};

int64_t topk_workspace_words(const TopkArgs& args);

void topk_cpu(const TopkArgs& args);
#if defined(LOWBIT_WITH_CUDA)
cudaError_t topk_cuda(const TopkArgs& args, cudaStream_t stream);
#endif

}  // namespace lowbit::topk
