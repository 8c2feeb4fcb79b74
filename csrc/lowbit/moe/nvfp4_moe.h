// NVFP4 mixture-of-experts (W4A16): the routed experts' MLPs and the
// weighted combine, out[t] = sum_j w[t, j] * Expert_{id[t, j]}(x[t]), with
// Expert_e(x) = W2_e (silu(min(g, L)) * clamp(u, -L, L)), [g; u] = W13_e x.
// Arguments are validated by the caller (csrc/torch); the CPU reference is
// moe_cpu (nvfp4_moe_cpu.cpp), the CUDA launcher moe_cuda (nvfp4_moe.cu).
//
// Weights: the Linear's prepacked layout (nvfp4_linear_layout.h), experts
// stacked along N, so expert e's tiles start at row e * N. W13's rows are
// interleaved at prepack (interleave_w13 in csrc/torch/moe_ops.cpp) so
// each 16-row tile holds gate rows 8 j .. 8 j + 7 and then the up rows of the
// same intermediate columns: the GEMM's epilogue finds gate and up of one
// output in the same lane and fuses the SwiGLU.
#pragma once

#include <optional>
#include <string>

#include "lowbit/common.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace lowbit::nvfp4::moe {

struct MoeArgs {
  const void* x;               // [M, H], dtype
  DType dtype;                 // kBFloat16 or kFloat16 (kFloat32 too on the CPU)
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

// The reference (host pointers, every array contiguous; x may also be
// kFloat32): per expert that received tokens, its weights dequantized to
// FP32, gate_up = x W13^T in FP32, the clamped SwiGLU in FP32, h rounded to
// x's dtype (as the GPU must round it for its second GEMM), y = h W2^T in
// FP32, accumulated with the routing weights in FP32 (experts in order, each
// expert's slots in slot order); the result is rounded once to x's dtype.
// Sums run in index order. Ids must lie in [0, E) (the binding checks them).
void moe_cpu(const MoeArgs& args);

// Choices of the CUDA plan (nvfp4_moe.cu) that a plan string forces for one
// call (lowbit/plan_string.h; tests and probes, through
// lowbit::_nvfp4_moe_with_plan); unset, the plan's own. Keys:
//   stream=0|1        one token on streaming warps (1, the plan's) or on the
//                     register-staged narrow kernels (0).
//   hot=0|1           experts with many rows in a hot list where it pays (1,
//                     the plan's) or left in the narrow list (0).
//   stream_warps=1|2|4|8  warps per W tile of the one-token streaming kernels.
struct MoePlanOverrides {
  std::optional<bool> stream;
  std::optional<bool> hot;
  std::optional<int> stream_warps;
};
// Throws std::invalid_argument naming the key of a bad item. Host code,
// built without CUDA too.
MoePlanOverrides parse_moe_plan_string(const std::string& plan);

// ---- The FP8 path (compute="auto" / "fp8") --------------------------------
// The experts' E4M3 form is made once from the prepacked weights
// (lowbit::nvfp4_moe_to_fp8: every expert row by the Linear's rule,
// nvfp4_linear.h, with its expert's global scale; W13's rows back in
// checkpoint order, gate rows then up rows). Per call, the CUDA binding
// (csrc/torch/moe_ops_cuda.cpp) runs:
//   fp8_moe_sort_cuda     x rounded to E4M3 per token row (the Linear's x
//                         rule) and written once per valid (token, slot)
//                         pair, grouped by expert: rows [offsets[e-1],
//                         offsets[e]) are expert e's;
//   up GEMM               [g | u] = x8 W13_e^T * scales, BF16 (cuBLASLt /
//                         CUTLASS grouped FP8 GEMM, at::_scaled_grouped_mm);
//   fp8_moe_act_cuda      a = silu(min(g, L)) * clamp(u, -L, L) in FP32,
//                         rounded to E4M3 per row by the same rule;
//   down GEMM             y = a8 W2_e^T * scales, BF16;
//   fp8_moe_combine_cuda  out[t] = sum_j w[t, j] y[row of (t, j)] in FP32
//                         (slot order), rounded once to x's dtype.
// The pairs' rows within an expert's group depend on the order in which
// CTAs claim them, but no row's value depends on its place: the result is
// the same bits on every call.
constexpr int64_t kMaxFp8Slots = 256;  // k of the FP8 path on CUDA (the sort kernel's shared row list)
struct Fp8MoeSortArgs {
  const void* x;               // [M, H], dtype (16-byte aligned rows)
  DType dtype;                 // kBFloat16 or kFloat16
  const int32_t* topk_ids;     // [M, k]; ids outside [0, E) get no row
  int64_t m, k, e, h;
  int32_t* counts;             // [E] scratch
  int32_t* cursor;             // [E] scratch
  int32_t* offsets;            // [E] out: end of each expert's rows (inclusive prefix sum of the counts)
  int32_t* split_offsets;      // [2E - 1] out, or null: the ends of `offsets` with an empty group after
                               // each expert's but the last (group 2e is expert e's rows)
  int32_t* pair_row;           // [M, k] out: the row of each pair, -1 for an id outside [0, E)
  uint8_t* x_fp8;              // [M k, H] out: E4M3 codes (rows past offsets[E-1] unwritten)
  float* x_scale;              // [M k] out: row scales
};
struct Fp8MoeActArgs {
  const void* gate_up;         // [rows, 2I] bfloat16: gate columns, then up columns
  const int32_t* offsets;      // [E]: rows past offsets[E-1] are skipped
  int64_t rows, e, inter;
  bool has_limit;
  float swiglu_limit;
  uint8_t* act_fp8;            // [rows, I] out: E4M3 codes
  float* act_scale;            // [rows] out
};
struct Fp8MoeCombineArgs {
  const void* y;               // [M k, H] bfloat16, rows as pair_row says
  const float* topk_weights;   // [M, k]
  const int32_t* pair_row;     // [M, k]
  int64_t m, k, h;
  DType dtype;                 // of out
  void* out;                   // [M, H]
};

#if defined(LOWBIT_WITH_CUDA)
cudaError_t fp8_moe_sort_cuda(const Fp8MoeSortArgs& args, cudaStream_t stream);
cudaError_t fp8_moe_act_cuda(const Fp8MoeActArgs& args, cudaStream_t stream);
cudaError_t fp8_moe_combine_cuda(const Fp8MoeCombineArgs& args, cudaStream_t stream);

// Workspace the launcher needs, in bytes, for this problem (caller allocates
// it, 256-byte aligned, from a stream-ordered allocator).
int64_t moe_workspace_bytes(const MoeArgs& args, const MoePlanOverrides& overrides = {});
// Upper bound on work items (grid dimension y, so at most kMaxWorkItems).
int64_t moe_max_work_items(const MoeArgs& args, const MoePlanOverrides& overrides = {});
constexpr int64_t kMaxWorkItems = 65535;
// `overrides` must be the ones the workspace was sized for.
cudaError_t moe_cuda(const MoeArgs& args, void* workspace, cudaStream_t stream,
                     const MoePlanOverrides& overrides = {});
#endif

}  // namespace lowbit::nvfp4::moe
