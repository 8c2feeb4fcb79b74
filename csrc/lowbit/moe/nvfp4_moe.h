// NVFP4 mixture-of-experts (W4A16) on CUDA: the routed experts' MLPs and the
// weighted combine, out[t] = sum_j w[t, j] * Expert_{id[t, j]}(x[t]), with
// Expert_e(x) = W2_e (silu(min(g, L)) * clamp(u, -L, L)), [g; u] = W13_e x.
// Arguments are validated by the caller (csrc/torch); the CPU reference lives
// in the binding (csrc/torch/moe_ops.cpp).
//
// Weights: the Linear's prepacked layout (nvfp4_linear_layout.h), experts
// stacked along N, so expert e's tiles start at row e * N. W13's rows are
// interleaved at prepack (interleave_w13 in csrc/torch/moe_ops.cpp) so
// each 16-row tile holds gate rows 8 j .. 8 j + 7 and then the up rows of the
// same intermediate columns: the GEMM's epilogue finds gate and up of one
// output in the same lane and fuses the SwiGLU.
#pragma once

#include "lowbit/common.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>

namespace lowbit::nvfp4::moe {

struct MoeArgs {
  const void* x;               // [M, H], dtype
  DType dtype;                 // kBFloat16 or kFloat16
  const float* topk_weights;   // [M, k]
  const int32_t* topk_ids;     // [M, k]; ids outside [0, E) are skipped
  const uint8_t* w13;          // [E, 2I, Hp/2] prepacked, rows interleaved
  const uint8_t* w13_scale;    // [E, 2I, Hp/16]
  const float* w13_global;     // [E]
  const uint8_t* w2;           // [E, H, Ip/2] prepacked
  const uint8_t* w2_scale;     // [E, H, Ip/16]
  const float* w2_global;      // [E]
  bool has_limit;
  float swiglu_limit;
  void* out;                   // [M, H], dtype
  int64_t m, k, e, h, inter;
};

// Workspace the launcher needs, in bytes, for this problem (caller allocates
// it, 256-byte aligned, from a stream-ordered allocator).
int64_t moe_workspace_bytes(const MoeArgs& args);
// Upper bound on work items (grid dimension y, so at most kMaxWorkItems).
int64_t moe_max_work_items(const MoeArgs& args);
constexpr int64_t kMaxWorkItems = 65535;
cudaError_t moe_cuda(const MoeArgs& args, void* workspace, cudaStream_t stream);

}  // namespace lowbit::nvfp4::moe
#endif
