// NVFP4 mixture-of-experts (W4A16) on CUDA: the routed experts' MLPs and the
// weighted combine, out[t] = sum_j w[t, j] * Expert_{id[t, j]}(x[t]), with
// Expert_e(x) = W2_e (silu(min(g, L)) * clamp(u, -L, L)), [g; u] = W13_e x.
// Arguments are validated by the caller (csrc/torch); the CPU reference lives
// in the binding (csrc/torch/nvfp4_moe_ops.cpp).
//
// Weights: the Linear's prepacked layout (nvfp4_gemm_layout.h), experts
// stacked along N, so expert e's tiles start at row e * N. W13's rows are
// interleaved by moe_w13_row so each 16-row tile holds 8 gate rows and the 8
// up rows of the same intermediate columns: the GEMM's epilogue finds gate and
// up of one output in the same lane and fuses the SwiGLU.
#pragma once

#include "lowbit/common.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace lowbit::nvfp4::moe {

// Row of the prepacked (interleaved) W13 that holds checkpoint row `row`
// (gate rows 0..I-1, up rows I..2I-1); I % 8 == 0.
LOWBIT_HD int64_t moe_w13_row(int64_t row, int64_t inter) {
  const bool up = row >= inter;
  const int64_t c = up ? row - inter : row;
  return (c / 8) * 16 + (up ? 8 : 0) + c % 8;
}

#if defined(LOWBIT_WITH_CUDA)
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
#endif

}  // namespace lowbit::nvfp4::moe
