// MoE routing: argument structs and the CPU and CUDA entry points of the
// dense routers (scoring + top-k selection + weights), the fused gate GEMM +
// router, and the DeepSeek-V4 hash router. Arguments are validated by the
// caller (csrc/torch does it); these functions trust shapes and pointers.
//
// The math (DeepSeek-V4 / V3 reference models):
//   s        = score(logits)                  sqrtsoftplus | sigmoid | softmax
//   biased   = s + bias                       (bias only selects experts)
//   groups   (n_group > 1): the E experts form n_group contiguous groups; a
//            group's score is the sum of its top-2 biased scores (top-1 when a
//            group has one expert); the best topk_group groups are kept and
//            experts of the other groups are never selected.
//   ids      = top-k of biased among the kept experts, in descending order;
//            equal scores go to the lower expert index. NaN ranks as -inf.
//   weights  = s[ids]; with renormalize, divided by (their sum + 1e-20);
//            then times routed_scaling_factor.
// Everything is computed in float32 from float32 or bf16 logits.
#pragma once

#include <math.h>

#include "lowbit/common.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace lowbit::routing {

// Scoring functions; the op schema takes their names ("sqrtsoftplus",
// "sigmoid", "softmax").
enum class ScoreFunc : int32_t { kSqrtSoftplus = 0, kSigmoid = 1, kSoftmax = 2 };

// Softplus as torch computes it (threshold 20: above it softplus(x) = x).
LOWBIT_HD float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Elementwise scores (softmax is a row operation and is handled apart).
LOWBIT_HD float elementwise_score(ScoreFunc f, float x) {
  return f == ScoreFunc::kSigmoid ? 1.f / (1.f + expf(-x)) : sqrtf(softplus(x));
}

// Selection key order: a beats b when its score is larger, or equal with a
// lower index. NaN is mapped to -inf before comparing.
LOWBIT_HD float selection_value(float v) { return v != v ? bits_float(0xff800000u) : v; }
LOWBIT_HD bool beats(float va, int32_t ia, float vb, int32_t ib) { return va > vb || (va == vb && ia < ib); }

constexpr float kRenormEpsilon = 1e-20f;

// Fast-path limits of the CUDA routing kernel (one warp per token, scores in
// registers); larger problems take the general kernel.
constexpr int kFastMaxExperts = 512;
constexpr int kFastMaxTopK = 32;
constexpr int kMaxGroups = 32;

struct RouteArgs {
  const void* logits;  // [M, E] contiguous, logits_dtype (float32 or bfloat16)
  DType logits_dtype;
  const float* bias;   // [E] or null
  int64_t tokens, experts;
  int32_t topk;        // 1 <= topk <= experts
  ScoreFunc score_func;
  int32_t n_group, topk_group;  // n_group divides experts, <= kMaxGroups; 1, 1 = no groups
  bool renormalize;
  float routed_scaling_factor;
  float* weights;      // [M, topk]
  int32_t* ids;        // [M, topk]
  float* workspace;    // CUDA general path only: [M, 2 * experts] floats (route_workspace_floats)
  // CUDA fast path only: logits is float32 [logit_splits, M, E], the split-K
  // partial sums of dense_gate_cuda, added in split order before scoring.
  int32_t logit_splits = 1;
  // CUDA: launched as a programmatic dependent of the kernel before it in
  // the stream (dense_gate_cuda), whose tail its launch overlaps.
  bool after_gate = false;
};

// Floats of device workspace route_cuda needs (0 on the fast path).
int64_t route_workspace_floats(const RouteArgs& args);

void route_cpu(const RouteArgs& args);

#if defined(LOWBIT_WITH_CUDA)
cudaError_t route_cuda(const RouteArgs& args, cudaStream_t stream);
#endif

// Gate GEMM of dense_router at small M on the GPU: bf16 hidden [M, H] times
// bf16 gate weight [E, H]^T on tensor cores, split over K, float32 partial
// sums partial[s, m, e] (summed in split order by route_cuda with
// logit_splits = splits). Deterministic: no atomics.
struct DenseGateArgs {
  const void* hidden;  // [M, H] bfloat16, 16-byte aligned
  const void* weight;  // [E, H] bfloat16, 16-byte aligned
  int64_t tokens, experts, hidden_size;
  int32_t splits;      // dense_gate_splits(tokens, experts, hidden_size)
  float* partial;      // [splits, M, E]
};

constexpr int64_t kDenseGateMaxTokens = 64;
// M <= 64, E a multiple of 16, H a multiple of 64.
inline bool dense_gate_supported(int64_t tokens, int64_t experts, int64_t hidden_size) {
  return tokens <= kDenseGateMaxTokens && experts % 16 == 0 && hidden_size % 64 == 0 && hidden_size > 0;
}
int32_t dense_gate_splits(int64_t tokens, int64_t experts, int64_t hidden_size);

#if defined(LOWBIT_WITH_CUDA)
cudaError_t dense_gate_cuda(const DenseGateArgs& args, cudaStream_t stream);
#endif

// DeepSeek-V4 hash router: ids = tid2eid[token_ids]; weights are the gate's
// scores at those experts (weighting kGate: score_func of logits[m, id],
// renormalized and scaled as above) or uniform (1/k times the scale, logits
// unused). A token id outside [0, vocab) or a table entry outside
// [0, experts) gives that token ids -1 and weights 0 on the GPU; the CPU
// kernel reports it through the return value (index of the bad token or -1).
enum class HashWeighting : int32_t { kGate = 0, kUniform = 1 };

struct HashRouteArgs {
  const void* token_ids;  // [M], int64 when token_ids_64 else int32
  bool token_ids_64;
  const int32_t* table;   // [vocab, topk] int32 (tid2eid)
  int64_t vocab;
  const void* logits;     // [M, E] (kGate) float32 or bfloat16
  DType logits_dtype;
  int64_t tokens, experts;
  int32_t topk;
  ScoreFunc score_func;   // sqrtsoftplus or sigmoid
  HashWeighting weighting;
  bool renormalize;
  float routed_scaling_factor;
  float* weights;         // [M, topk]
  int32_t* ids;           // [M, topk]
};

// Returns -1, or the first token whose id (or table row) is out of range.
int64_t hash_route_cpu(const HashRouteArgs& args);
#if defined(LOWBIT_WITH_CUDA)
cudaError_t hash_route_cuda(const HashRouteArgs& args, cudaStream_t stream);
#endif

}  // namespace lowbit::routing
