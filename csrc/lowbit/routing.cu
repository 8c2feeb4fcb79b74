// CUDA kernels of the MoE routers (routing.h).
//
// route: one warp per token. On the fast path (E <= 512, k <= 32) each lane
// holds experts lane, lane + 32, ... in registers; group scores are warp
// top-2 reductions; each of the k picks is a warp argmax over the experts
// that rank below the previous pick in the (score desc, index asc) order, so
// nothing is ever removed or re-sorted. The general path keeps the scores in
// a global workspace instead of registers and runs the same loop.
//
// hash_route: one warp per token, lanes over the k table entries.
#include "lowbit/cuda_utils.cuh"
#include "lowbit/routing.h"
#include "lowbit/topk.h"

namespace lowbit::routing {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarpsPerBlock = 4;
constexpr int32_t kPadIndex = 0x7fffffff;

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

template <typename T>
__device__ __forceinline__ float load_logit(const T* p) {
  return cuda::to_float(__ldg(p));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, off));
  return v;
}

// Every lane ends with the best (v, i) of the warp.
__device__ __forceinline__ void warp_argmax(float& v, int32_t& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(kFull, v, off);
    const int32_t oi = __shfl_xor_sync(kFull, i, off);
    if (beats(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// Keeps (v1, i1) >= (v2, i2) the two best seen.
__device__ __forceinline__ void push_top2(float v, int32_t i, float& v1, int32_t& i1, float& v2, int32_t& i2) {
  if (beats(v, i, v1, i1)) {
    v2 = v1;
    i2 = i1;
    v1 = v;
    i1 = i;
  } else if (beats(v, i, v2, i2)) {
    v2 = v;
    i2 = i;
  }
}

struct Params {
  int32_t experts, topk;
  ScoreFunc score_func;
  int32_t n_group, topk_group;
  bool renormalize;
  float scale;
};

Params params_of(const RouteArgs& a) {
  return Params{static_cast<int32_t>(a.experts), a.topk, a.score_func, a.n_group, a.topk_group, a.renormalize,
                a.routed_scaling_factor};
}

// Scores of one token in a global workspace: s at [0, E), biased at [E, 2E).
struct MemScores {
  float* s;
  float* b;
  int32_t experts;
  uint32_t keep = kFull;
  int group_size = 1 << 30;

  template <typename F>
  __device__ __forceinline__ void each(F f) const {
    for (int e = threadIdx.x & 31; e < experts; e += 32)
      if ((keep >> (e / group_size)) & 1u) f(e, s[e], b[e]);
  }
  __device__ __forceinline__ void keep_groups(uint32_t k, int gs) {
    keep = k;
    group_size = gs;
  }
  __device__ __forceinline__ float score_at(int e) const { return s[e]; }
};

template <typename T>
__device__ __forceinline__ void load_scores(MemScores& r, const T* row, const float* bias, const Params& p) {
  const int lane = threadIdx.x & 31;
  float mx = neg_inf();
  for (int e = lane; e < p.experts; e += 32) {
    const float x = load_logit<T>(row + e);
    r.s[e] = x;
    mx = fmaxf(mx, x);
  }
  if (p.score_func == ScoreFunc::kSoftmax) {
    mx = warp_max(mx);
    float sum = 0.f;
    for (int e = lane; e < p.experts; e += 32) {
      r.s[e] = expf(r.s[e] - mx);
      sum += r.s[e];
    }
    sum = warp_sum(sum);
    for (int e = lane; e < p.experts; e += 32) r.s[e] /= sum;
  } else {
    for (int e = lane; e < p.experts; e += 32) r.s[e] = elementwise_score(p.score_func, r.s[e]);
  }
  for (int e = lane; e < p.experts; e += 32) r.b[e] = selection_value(bias ? r.s[e] + __ldg(bias + e) : r.s[e]);
  __syncwarp();
}

// Group limit, selection and weights for one token whose scores are loaded.
template <typename Scores>
__device__ __forceinline__ void select_and_write(Scores& r, const Params& p, float* weights, int32_t* ids) {
  const int lane = threadIdx.x & 31;
  if (p.n_group > 1) {
    const int group_size = p.experts / p.n_group;
    float my_group = neg_inf();
    for (int g = 0; g < p.n_group; ++g) {
      float v1 = neg_inf(), v2 = neg_inf();
      int32_t i1 = kPadIndex, i2 = kPadIndex;
      r.each([&](int e, float, float b) {
        if (e / group_size == g) push_top2(b, e, v1, i1, v2, i2);
      });
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float ov1 = __shfl_xor_sync(kFull, v1, off), ov2 = __shfl_xor_sync(kFull, v2, off);
        const int32_t oi1 = __shfl_xor_sync(kFull, i1, off), oi2 = __shfl_xor_sync(kFull, i2, off);
        push_top2(ov1, oi1, v1, i1, v2, i2);
        push_top2(ov2, oi2, v1, i1, v2, i2);
      }
      if (lane == g) my_group = selection_value(group_size > 1 ? v1 + v2 : v1);
    }
    uint32_t keep = 0;
    float last_v = 0.f;
    int32_t last_i = -1;
    for (int j = 0; j < p.topk_group; ++j) {
      float v = neg_inf();
      int32_t i = kPadIndex;
      if (lane < p.n_group && (last_i < 0 || beats(last_v, last_i, my_group, lane))) {
        v = my_group;
        i = lane;
      }
      warp_argmax(v, i);
      keep |= 1u << i;
      last_v = v;
      last_i = i;
    }
    r.keep_groups(keep, group_size);
  }

  float my_w = 0.f;
  int32_t my_id = 0;
  float last_v = 0.f;
  int32_t last_i = -1;
  for (int j = 0; j < p.topk; ++j) {
    float v = neg_inf();
    int32_t i = kPadIndex;
    r.each([&](int e, float, float b) {
      if ((last_i < 0 || beats(last_v, last_i, b, e)) && beats(b, e, v, i)) {
        v = b;
        i = e;
      }
    });
    warp_argmax(v, i);
    const float w = r.score_at(i);
    if ((j & 31) == lane) {
      my_w = w;
      my_id = i;
    }
    if ((j & 31) == 31 || j == p.topk - 1) {
      // k > 32 only on the general path: flush this batch of 32 picks.
      const int base = j & ~31;
      if (base + lane <= j) {
        weights[base + lane] = my_w;
        ids[base + lane] = my_id;
      }
    }
    last_v = v;
    last_i = i;
  }
  __syncwarp();
  if (p.topk <= 32) {
    float sum = warp_sum(lane < p.topk ? my_w : 0.f);
    if (lane < p.topk) {
      float w = my_w;
      if (p.renormalize) w /= sum + kRenormEpsilon;
      weights[lane] = w * p.scale;
    }
  } else {
    float sum = 0.f;
    for (int j = lane; j < p.topk; j += 32) sum += weights[j];
    sum = warp_sum(sum);
    __syncwarp();
    for (int j = lane; j < p.topk; j += 32) {
      float w = weights[j];
      if (p.renormalize) w /= sum + kRenormEpsilon;
      weights[j] = w * p.scale;
    }
  }
}

// Fast path: one warp routes one token, lane l holding experts l + 32 j in
// registers as 32-bit order keys of the biased score (0 = not selectable).
// Each pick is two warp reductions (redux.sync): the largest key, then the
// lowest expert index holding it. Group scores are computed by lane g over
// group g from a per-warp shared copy of the biased scores.
template <int EPT, typename T>
__device__ __forceinline__ void route_token_fast(const T* row, const float* bias, const Params& p, float* group_smem,
                                                 float* weights, int32_t* ids) {
  const int lane = threadIdx.x & 31;
  float x[EPT], s[EPT], bias_v[EPT];
  uint32_t key[EPT];
  // Logits and bias are loaded together: one memory round trip per token.
#pragma unroll
  for (int j = 0; j < EPT; ++j) {
    const int e = lane + 32 * j;
    x[j] = e < p.experts ? load_logit<T>(row + e) : 0.f;
    bias_v[j] = bias && e < p.experts ? __ldg(bias + e) : 0.f;
  }
  if (p.score_func == ScoreFunc::kSoftmax) {
    float mx = neg_inf();
#pragma unroll
    for (int j = 0; j < EPT; ++j)
      if (lane + 32 * j < p.experts) mx = fmaxf(mx, x[j]);
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      s[j] = lane + 32 * j < p.experts ? expf(x[j] - mx) : 0.f;
      sum += s[j];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int j = 0; j < EPT; ++j) s[j] /= sum;
  } else {
#pragma unroll
    for (int j = 0; j < EPT; ++j) s[j] = elementwise_score(p.score_func, x[j]);
  }
#pragma unroll
  for (int j = 0; j < EPT; ++j) {
    const int e = lane + 32 * j;
    const float b = selection_value(bias ? s[j] + bias_v[j] : s[j]);
    key[j] = e < p.experts ? topk::order_key(b) : 0u;
    if (p.n_group > 1 && e < p.experts) group_smem[e] = b;
  }

  if (p.n_group > 1) {
    __syncwarp();
    const int group_size = p.experts / p.n_group;
    uint32_t gkey = 0;
    if (lane < p.n_group) {
      float v1 = neg_inf(), v2 = neg_inf();
      for (int i = 0; i < group_size; ++i) {
        const float v = group_smem[lane * group_size + i];
        if (v > v1) {
          v2 = v1;
          v1 = v;
        } else if (v > v2) {
          v2 = v;
        }
      }
      gkey = topk::order_key(selection_value(group_size > 1 ? v1 + v2 : v1));
    }
    uint32_t keep = 0;
    for (int it = 0; it < p.topk_group; ++it) {
      const uint32_t m = __reduce_max_sync(kFull, gkey);
      const uint32_t g = __reduce_min_sync(kFull, gkey == m && lane < p.n_group ? uint32_t(lane) : 32u);
      keep |= 1u << g;
      if (lane == int(g)) gkey = 0;
    }
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      const int e = lane + 32 * j;
      if (e < p.experts && !((keep >> (e / group_size)) & 1u)) key[j] = 0;
    }
    __syncwarp();
  }

  float my_w = 0.f;
  int32_t my_id = 0;
  for (int it = 0; it < p.topk; ++it) {
    uint32_t bk = 0;
    int bj = 0;
    float bs = 0.f;
#pragma unroll
    for (int j = 0; j < EPT; ++j)
      if (key[j] > bk) {  // strict: the lowest slot (lowest index) wins ties
        bk = key[j];
        bj = j;
        bs = s[j];
      }
    const uint32_t m = __reduce_max_sync(kFull, bk);
    const uint32_t win = __reduce_min_sync(kFull, bk == m ? uint32_t(lane + 32 * bj) : 0xffffffffu);
    const float w = __shfl_sync(kFull, bs, win & 31);
    if (lane == int(win & 31)) {
#pragma unroll
      for (int j = 0; j < EPT; ++j)
        if (j == bj) key[j] = 0;
    }
    if (lane == it) {
      my_w = w;
      my_id = static_cast<int32_t>(win);
    }
  }
  const float sum = warp_sum(lane < p.topk ? my_w : 0.f);
  if (lane < p.topk) {
    float w = my_w;
    if (p.renormalize) w /= sum + kRenormEpsilon;
    weights[lane] = w * p.scale;
    ids[lane] = my_id;
  }
}

template <int EPT, typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    route_fast_kernel(const T* __restrict__ logits, const float* __restrict__ bias, int64_t tokens, Params p,
                      float* __restrict__ weights, int32_t* __restrict__ ids) {
  const int64_t m = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  __shared__ float group_smem[kWarpsPerBlock][kFastMaxExperts];
  if (m >= tokens) return;
  route_token_fast<EPT, T>(logits + m * p.experts, bias, p, group_smem[threadIdx.x >> 5], weights + m * p.topk,
                                  ids + m * p.topk);
}

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    route_general_kernel(const T* __restrict__ logits, const float* __restrict__ bias, int64_t tokens, Params p,
                         float* workspace, float* weights, int32_t* ids) {
  const int64_t m = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (m >= tokens) return;
  MemScores r{workspace + m * 2 * p.experts, workspace + m * 2 * p.experts + p.experts, p.experts};
  load_scores<T>(r, logits + m * p.experts, bias, p);
  select_and_write(r, p, weights + m * p.topk, ids + m * p.topk);
}

template <typename T>
cudaError_t route_typed(const RouteArgs& a, cudaStream_t stream) {
  const T* logits = static_cast<const T*>(a.logits);
  const Params p = params_of(a);
  const unsigned grid = static_cast<unsigned>(cuda::ceil_div(a.tokens, kWarpsPerBlock));
  const int threads = kWarpsPerBlock * 32;
  if (route_workspace_floats(a) > 0) {
    route_general_kernel<T><<<grid, threads, 0, stream>>>(logits, a.bias, a.tokens, p, a.workspace, a.weights, a.ids);
    return cudaGetLastError();
  }
#define LOWBIT_ROUTE_FAST(EPT) \
  route_fast_kernel<EPT, T><<<grid, threads, 0, stream>>>(logits, a.bias, a.tokens, p, a.weights, a.ids)
  if (a.experts <= 32)
    LOWBIT_ROUTE_FAST(1);
  else if (a.experts <= 64)
    LOWBIT_ROUTE_FAST(2);
  else if (a.experts <= 128)
    LOWBIT_ROUTE_FAST(4);
  else if (a.experts <= 256)
    LOWBIT_ROUTE_FAST(8);
  else if (a.experts <= 384)
    LOWBIT_ROUTE_FAST(12);
  else
    LOWBIT_ROUTE_FAST(16);
#undef LOWBIT_ROUTE_FAST
  return cudaGetLastError();
}

// ---- hash router --------------------------------------------------------------

template <typename Tid, typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    hash_route_kernel(const Tid* __restrict__ token_ids, const int32_t* __restrict__ table, int64_t vocab,
                      const T* __restrict__ logits, int64_t tokens, int64_t experts, int32_t topk,
                      ScoreFunc score_func, HashWeighting weighting, bool renormalize, float scale,
                      float* __restrict__ weights, int32_t* __restrict__ ids) {
  const int64_t m = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (m >= tokens) return;
  const int lane = threadIdx.x & 31;
  const int64_t tid = static_cast<int64_t>(__ldg(token_ids + m));
  const bool gate = weighting == HashWeighting::kGate;
  bool bad = tid < 0 || tid >= vocab;
  float sum = 0.f;
  for (int j = lane; j < topk && !bad; j += 32) {
    const int32_t e = __ldg(table + tid * topk + j);
    if (gate && (e < 0 || e >= experts)) bad = true;
  }
  bad = __any_sync(kFull, bad);
  float* w = weights + m * topk;
  int32_t* out_ids = ids + m * topk;
  if (bad) {
    for (int j = lane; j < topk; j += 32) {
      w[j] = 0.f;
      out_ids[j] = -1;
    }
    return;
  }
  for (int j = lane; j < topk; j += 32) {
    const int32_t e = __ldg(table + tid * topk + j);
    const float s = gate ? elementwise_score(score_func, cuda::to_float(__ldg(logits + m * experts + e)))
                         : 1.f / static_cast<float>(topk);
    out_ids[j] = e;
    w[j] = s;
    sum += s;
  }
  sum = warp_sum(sum);
  __syncwarp();
  for (int j = lane; j < topk; j += 32) {
    float s = w[j];
    if (gate && renormalize) s /= sum + kRenormEpsilon;
    w[j] = s * scale;
  }
}

template <typename Tid>
cudaError_t hash_typed(const HashRouteArgs& a, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(cuda::ceil_div(a.tokens, kWarpsPerBlock));
  const Tid* tids = static_cast<const Tid*>(a.token_ids);
  if (a.logits_dtype == DType::kBFloat16)
    hash_route_kernel<Tid, __nv_bfloat16><<<grid, kWarpsPerBlock * 32, 0, stream>>>(
        tids, a.table, a.vocab, static_cast<const __nv_bfloat16*>(a.logits), a.tokens, a.experts, a.topk,
        a.score_func, a.weighting, a.renormalize, a.routed_scaling_factor, a.weights, a.ids);
  else
    hash_route_kernel<Tid, float><<<grid, kWarpsPerBlock * 32, 0, stream>>>(
        tids, a.table, a.vocab, static_cast<const float*>(a.logits), a.tokens, a.experts, a.topk, a.score_func,
        a.weighting, a.renormalize, a.routed_scaling_factor, a.weights, a.ids);
  return cudaGetLastError();
}

}  // namespace

cudaError_t route_cuda(const RouteArgs& a, cudaStream_t stream) {
  if (a.tokens == 0) return cudaSuccess;
  return a.logits_dtype == DType::kBFloat16 ? route_typed<__nv_bfloat16>(a, stream) : route_typed<float>(a, stream);
}

cudaError_t hash_route_cuda(const HashRouteArgs& a, cudaStream_t stream) {
  if (a.tokens == 0) return cudaSuccess;
  return a.token_ids_64 ? hash_typed<int64_t>(a, stream) : hash_typed<int32_t>(a, stream);
}

}  // namespace lowbit::routing
