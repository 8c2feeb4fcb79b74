// CUDA kernels of the MoE routers (routing.h).
//
// route, fast path (E <= 512, k <= 32): a token's scores live in registers
// of one warp (large M) or of a whole CTA (M <= 256); each pick is two warp
// reductions, see "Fast path" below. The general path keeps one warp per
// token and its scores in a global workspace; each of its k picks is a warp
// argmax over the experts that rank below the previous pick in the (score
// desc, index asc) order, so nothing is ever removed or re-sorted.
//
// dense_gate: dense_router's split-K tensor-core gate GEMM at M <= 64,
// whose float32 partials the route kernel adds (launched as its dependent).
//
// hash_route: one warp per token, lanes over the k table entries.
#include <type_traits>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/routing/routing.h"
#include "lowbit/routing/topk.h"

namespace lowbit::routing {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarpsPerBlock = 4;
constexpr int32_t kPadIndex = 0x7fffffff;
// Up to this many tokens a whole CTA routes each token (see the fast path).
constexpr int64_t kTeamMaxTokens = 256;

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

// A plain (coherent) load: the logits may be the output of the kernel
// before this one, still running while this one starts (launch_dependent),
// which a non-coherent load (__ldg) may not see even after the wait.
template <typename T>
__device__ __forceinline__ float load_logit(const T* p) {
  return cuda::to_float(*p);
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

// Fast path (E <= 512, k <= 32): the scores of one token live in registers
// as 32-bit order keys of the biased score (0 = not selectable), slot j of
// team thread r holding expert r + 32 W j. A team is one warp (W = 1, four
// tokens per CTA) or, at small M, the whole CTA (W = kWarpsPerBlock): there
// the kernel time is one token's serial chain (load, scores, k picks), and
// four warps cut each thread's scores and the length of each pick's slot
// scan by four.
//
// A pick is two warp reductions (redux.sync): the largest key, then the
// lowest expert index holding it. With W > 1 each warp picks its own top k,
// and warp 0 merges the W k candidates by rank (the number of candidates
// that beat each one), so every thread does one pass over them instead of k
// more reductions. Both teams produce the same picks in the same order and
// sum the weights the same way (bitwise equal results except softmax, whose
// normalizer is summed per warp first).
template <int W>
struct Team {
  __device__ static int rank() { return W == 1 ? int(threadIdx.x & 31) : int(threadIdx.x); }
  __device__ static void sync() {
    if constexpr (W == 1)
      __syncwarp();
    else
      __syncthreads();
  }
};

// Shared memory of one token's team.
template <int W>
struct TeamSmem {
  float biased[kFastMaxExperts];  // group stage: the biased scores
  float partial[W];               // softmax: per-warp max / sum
  uint32_t cand_key[W][kFastMaxTopK];
  int32_t cand_id[W][kFastMaxTopK];
  float cand_score[W][kFastMaxTopK];
  float pick_w[kFastMaxTopK];
  int32_t pick_id[kFastMaxTopK];
};

// Max / sum over the team, every thread gets it; warps are combined in order.
template <int W, bool kMax>
__device__ __forceinline__ float team_reduce(float v, float* partial) {
  v = kMax ? warp_max(v) : warp_sum(v);
  if constexpr (W > 1) {
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    v = partial[0];
#pragma unroll
    for (int w = 1; w < W; ++w) v = kMax ? fmaxf(v, partial[w]) : v + partial[w];
    __syncthreads();  // partial is reused by the next reduction
  }
  return v;
}

// Lanes 0 .. k-1 of one warp hold pick `lane` (unnormalized weight and id):
// renormalize, scale and store.
__device__ __forceinline__ void write_picks(float my_w, int32_t my_id, const Params& p, float* weights, int32_t* ids) {
  const int lane = threadIdx.x & 31;
  const float sum = warp_sum(lane < p.topk ? my_w : 0.f);
  if (lane < p.topk) {
    float w = my_w;
    if (p.renormalize) w /= sum + kRenormEpsilon;
    weights[lane] = w * p.scale;
    ids[lane] = my_id;
  }
}

// `row` is the token's logits; with splits > 1 (dense_router's split-K gate)
// the logits are the sum of `splits` float32 partial rows split_stride apart,
// added in split order, the loads of a batch of splits issued together.
template <int EPT, int W, typename T>
__device__ __forceinline__ void route_token_fast(const T* row, int32_t splits, int64_t split_stride,
                                                 const float* bias, const Params& p, TeamSmem<W>& sm, float* weights,
                                                 int32_t* ids) {
  const int lane = threadIdx.x & 31, warp = W == 1 ? 0 : int(threadIdx.x >> 5);
  const auto expert = [&](int j) { return Team<W>::rank() + 32 * W * j; };
  float x[EPT], s[EPT], bias_v[EPT];
  uint32_t key[EPT];
  // Logits and bias are loaded together: one memory round trip per token.
  // The bias is not written by the kernel before this one (dense_router's
  // gate, which may still be running: cuda::launch_dependent).
#pragma unroll
  for (int j = 0; j < EPT; ++j) bias_v[j] = bias && expert(j) < p.experts ? __ldg(bias + expert(j)) : 0.f;
  cuda::wait_for_previous_grid();
#pragma unroll
  for (int j = 0; j < EPT; ++j) x[j] = expert(j) < p.experts ? load_logit<T>(row + expert(j)) : 0.f;
  constexpr int kBatch = EPT <= 4 ? 16 : EPT <= 8 ? 4 : 2;
  for (int32_t sp = 1; std::is_same_v<T, float> && sp < splits; sp += kBatch) {  // float32 partials only
    float v[kBatch][EPT];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
#pragma unroll
      for (int j = 0; j < EPT; ++j) {
        const int e = expert(j);
        v[u][j] = sp + u < splits && e < p.experts ? load_logit<T>(row + (sp + u) * split_stride + e) : 0.f;
      }
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
#pragma unroll
      for (int j = 0; j < EPT; ++j) x[j] += v[u][j];
  }

  if (p.score_func == ScoreFunc::kSoftmax) {
    float mx = neg_inf();
#pragma unroll
    for (int j = 0; j < EPT; ++j)
      if (expert(j) < p.experts) mx = fmaxf(mx, x[j]);
    mx = team_reduce<W, true>(mx, sm.partial);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      s[j] = expert(j) < p.experts ? expf(x[j] - mx) : 0.f;
      sum += s[j];
    }
    sum = team_reduce<W, false>(sum, sm.partial);
#pragma unroll
    for (int j = 0; j < EPT; ++j) s[j] /= sum;
  } else {
#pragma unroll
    for (int j = 0; j < EPT; ++j) s[j] = elementwise_score(p.score_func, x[j]);
  }
#pragma unroll
  for (int j = 0; j < EPT; ++j) {
    const int e = expert(j);
    const float b = selection_value(bias ? s[j] + bias_v[j] : s[j]);
    key[j] = e < p.experts ? topk::order_key(b) : 0u;
    if (p.n_group > 1 && e < p.experts) sm.biased[e] = b;
  }

  if (p.n_group > 1) {
    // Every warp of the team ranks the groups itself (lane g scores group
    // g): no second team barrier.
    Team<W>::sync();
    const int group_size = p.experts / p.n_group;
    uint32_t gkey = 0;
    if (lane < p.n_group) {
      float v1 = neg_inf(), v2 = neg_inf();
      for (int i = 0; i < group_size; ++i) {
        const float v = sm.biased[lane * group_size + i];
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
      const int e = expert(j);
      if (e < p.experts && !((keep >> (e / group_size)) & 1u)) key[j] = 0;
    }
  }

  // k picks over this warp's experts.
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
    const uint32_t win = __reduce_min_sync(kFull, bk == m ? uint32_t(expert(bj)) : 0xffffffffu);
    const float w = __shfl_sync(kFull, bs, win & 31);
    if (lane == int(win & 31)) {
#pragma unroll
      for (int j = 0; j < EPT; ++j)
        if (j == bj) key[j] = 0;
    }
    if (lane == it) {
      my_w = w;
      my_id = static_cast<int32_t>(win);
      if constexpr (W > 1) {
        sm.cand_key[warp][it] = m;
        sm.cand_id[warp][it] = my_id;
        sm.cand_score[warp][it] = w;
      }
    }
  }
  if constexpr (W == 1) {
    write_picks(my_w, my_id, p, weights, ids);
  } else {
    // Merge: candidate c lands at its rank among all W k candidates. A warp
    // with fewer than k selectable experts contributes key-0 candidates,
    // which rank below the k real winners (there are at least k selectable
    // experts: the op checks it).
    __syncthreads();
    if (warp != 0) return;
    const int n = W * p.topk;
    for (int c = lane; c < n; c += 32) {
      const int cw = c / p.topk, cj = c % p.topk;
      const uint32_t ck = sm.cand_key[cw][cj];
      const int32_t ci = sm.cand_id[cw][cj];
      int rank = 0;
      for (int o = 0; o < n; ++o) {
        const uint32_t ok = sm.cand_key[o / p.topk][o % p.topk];
        const int32_t oi = sm.cand_id[o / p.topk][o % p.topk];
        rank += ok > ck || (ok == ck && oi < ci);
      }
      if (rank < p.topk) {
        sm.pick_w[rank] = sm.cand_score[cw][cj];
        sm.pick_id[rank] = ci;
      }
    }
    __syncwarp();
    write_picks(lane < p.topk ? sm.pick_w[lane] : 0.f, lane < p.topk ? sm.pick_id[lane] : 0, p, weights, ids);
  }
}

// W = 1: four tokens per CTA, a warp each. W = kWarpsPerBlock: a token per CTA.
template <int EPT, int W, typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    route_fast_kernel(const T* logits, int32_t splits, cuda::ReadOnly<float> bias, int64_t tokens, Params p,
                      float* __restrict__ weights, int32_t* __restrict__ ids) {
  constexpr int kTeams = kWarpsPerBlock / W;
  __shared__ TeamSmem<W> smem[kTeams];
  const int team = W == 1 ? int(threadIdx.x >> 5) : 0;
  const int64_t m = int64_t(blockIdx.x) * kTeams + team;
  if (m >= tokens) return;  // the whole team: m is the same for all its threads
  route_token_fast<EPT, W, T>(logits + m * p.experts, splits, tokens * p.experts, bias, p, smem[team],
                              weights + m * p.topk, ids + m * p.topk);
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
    if (a.logit_splits != 1) return cudaErrorInvalidValue;  // split logits: fast path only
    route_general_kernel<T><<<grid, threads, 0, stream>>>(logits, a.bias, a.tokens, p, a.workspace, a.weights, a.ids);
    return cudaGetLastError();
  }
  // A launch right after dense_router's gate overlaps its tail.
  const auto launch = [&](auto kernel, unsigned blocks) {
    if (a.after_gate)
      return cuda::launch_dependent(kernel, blocks, threads, 0, stream, logits, a.logit_splits, a.bias, a.tokens, p,
                                    a.weights, a.ids);
    kernel<<<blocks, threads, 0, stream>>>(logits, a.logit_splits, a.bias, a.tokens, p, a.weights, a.ids);
    return cudaGetLastError();
  };
  if (a.tokens <= kTeamMaxTokens && a.experts > 64) {
    // A CTA per token, 128 experts per slot.
    const auto blocks = static_cast<unsigned>(a.tokens);
    if (a.experts <= 128) return launch(route_fast_kernel<1, kWarpsPerBlock, T>, blocks);
    if (a.experts <= 256) return launch(route_fast_kernel<2, kWarpsPerBlock, T>, blocks);
    if (a.experts <= 384) return launch(route_fast_kernel<3, kWarpsPerBlock, T>, blocks);
    return launch(route_fast_kernel<4, kWarpsPerBlock, T>, blocks);
  }
  if (a.experts <= 32) return launch(route_fast_kernel<1, 1, T>, grid);
  if (a.experts <= 64) return launch(route_fast_kernel<2, 1, T>, grid);
  if (a.experts <= 128) return launch(route_fast_kernel<4, 1, T>, grid);
  if (a.experts <= 256) return launch(route_fast_kernel<8, 1, T>, grid);
  if (a.experts <= 384) return launch(route_fast_kernel<12, 1, T>, grid);
  return launch(route_fast_kernel<16, 1, T>, grid);
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
    if (e < 0 || e >= experts) bad = true;
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


// ---- dense_router gate GEMM (small M) -------------------------------------------
//
// mma.m16n8k16 with 16 experts as the 16-row operand and 8 tokens as the
// 8-wide one. Each warp step covers a 64-column chunk: lane (g, t) loads 32
// contiguous bytes (columns 16 t .. 16 t + 15) of expert rows g and g + 8
// and of token row g, and uses columns 4 j .. 4 j + 3 of them as the
// fragment of k-step j, i.e. K is permuted the same way for both operands
// inside each chunk, which leaves the dot products unchanged and makes every
// load a coalesced 16-byte one. grid: (E / (16 ET), splits, token blocks); a split is
// kGateWarps x CPW chunks, warp w takes CPW consecutive ones and issues all
// their loads before its first mma (the gate is a pure weight stream: what
// counts is the bytes in flight), and the CTA adds its warps' sums in warp
// order.

constexpr int kGateWarps = 4;
constexpr int kGateChunk = 64;

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Per M: token tiles of 8 (MT), chunks per warp (CPW) and 16-expert tiles
// per warp (ET, sharing the x fragments: halves the x reads from L2 when x
// is the larger stream). The fragments of all CPW chunks live in registers,
// which caps a CTA at 32 tokens: above that, blocks of 32 tokens run side
// by side (grid z) on the same splits, so the split count (the partials the
// route kernel adds) stays that of M = 32.
struct GateShape {
  int mt, cpw, et;
};
constexpr GateShape gate_shape(int64_t tokens, int64_t experts) {
  const int mt = tokens <= 8 ? 1 : tokens <= 16 ? 2 : 4;
  return {mt, 2, mt >= 4 && experts % 32 == 0 ? 2 : 1};
}

template <int MT, int CPW, int ET>
__global__ void __launch_bounds__(kGateWarps * 32)
    dense_gate_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, int64_t tokens,
                      int64_t experts, int64_t hidden, float* __restrict__ partial) {
  cuda::allow_dependent_launch();  // the route kernel's launch and bias loads overlap this one
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t e0 = int64_t(blockIdx.x) * 16 * ET;
  const int64_t m0 = int64_t(blockIdx.z) * MT * 8;  // first token of the CTA
  const int64_t chunk0 = (int64_t(blockIdx.y) * kGateWarps + warp) * CPW;
  const int64_t chunks = hidden / kGateChunk;
  const __nv_bfloat16* xrow[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) xrow[mt] = x + min(m0 + mt * 8 + g, tokens - 1) * hidden + 16 * t;  // rows past M: never stored

  // lo / hi: expert rows g and g + 8 of each expert tile.
  uint4 lo[CPW][ET][2], hi[CPW][ET][2], xv[CPW][MT][2];
#pragma unroll
  for (int c = 0; c < CPW; ++c) {
    const int64_t col = (chunk0 + c) * kGateChunk + 16 * t;
    const bool valid = chunk0 + c < chunks;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int et = 0; et < ET; ++et) {
        const __nv_bfloat16* row = w + (e0 + 16 * et + g) * hidden + col;
        lo[c][et][h] = valid ? __ldg(reinterpret_cast<const uint4*>(row) + h) : uint4{};
        hi[c][et][h] = valid ? __ldg(reinterpret_cast<const uint4*>(row + 8 * hidden) + h) : uint4{};
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        xv[c][mt][h] = valid ? __ldg(reinterpret_cast<const uint4*>(xrow[mt] + col - 16 * t) + h) : uint4{};
    }
  }
  float acc[ET][MT][4];
#pragma unroll
  for (int et = 0; et < ET; ++et)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[et][mt][i] = 0.f;
#pragma unroll
  for (int c = 0; c < CPW; ++c)
#pragma unroll
    for (int et = 0; et < ET; ++et) {
      const uint32_t* wl = reinterpret_cast<const uint32_t*>(lo[c][et]);
      const uint32_t* wh = reinterpret_cast<const uint32_t*>(hi[c][et]);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint32_t* xw = reinterpret_cast<const uint32_t*>(xv[c][mt]);
          mma_bf16(acc[et][mt], wl[2 * j], wh[2 * j], wl[2 * j + 1], wh[2 * j + 1], xw[2 * j], xw[2 * j + 1]);
        }
    }

  __shared__ float sums[kGateWarps][ET][MT][4][32];
#pragma unroll
  for (int et = 0; et < ET; ++et)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) sums[warp][et][mt][i][lane] = acc[et][mt][i];
  __syncthreads();
  // c0, c1: expert g, tokens 2t, 2t+1; c2, c3: expert g + 8, same tokens.
  for (int o = threadIdx.x; o < MT * 8 * 16 * ET; o += kGateWarps * 32) {
    const int er = o % (16 * ET), mc = o / (16 * ET);  // expert row in the CTA's tiles, token
    const int et = er / 16, mt = mc / 8, col = mc % 8;
    const int src = (er % 8) * 4 + col / 2, reg = (er % 16 / 8) * 2 + (col % 2);
    if (m0 + mc >= tokens) continue;
    float v = 0.f;
#pragma unroll
    for (int wi = 0; wi < kGateWarps; ++wi) v += sums[wi][et][mt][reg][src];
    partial[(int64_t(blockIdx.y) * tokens + m0 + mc) * experts + e0 + er] = v;
  }
}

}  // namespace

int32_t dense_gate_splits(int64_t tokens, int64_t experts, int64_t hidden_size) {
  const int64_t per_split = int64_t(kGateWarps) * gate_shape(tokens, experts).cpw;
  return static_cast<int32_t>(cuda::ceil_div(hidden_size / kGateChunk, per_split));
}

cudaError_t dense_gate_cuda(const DenseGateArgs& a, cudaStream_t stream) {
  if (a.tokens == 0 || a.experts == 0) return cudaSuccess;
  if (!dense_gate_supported(a.tokens, a.experts, a.hidden_size) ||
      a.splits != dense_gate_splits(a.tokens, a.experts, a.hidden_size))
    return cudaErrorInvalidValue;
  const GateShape s = gate_shape(a.tokens, a.experts);
  const dim3 grid(static_cast<unsigned>(a.experts / (16 * s.et)), static_cast<unsigned>(a.splits),
                  static_cast<unsigned>(cuda::ceil_div(a.tokens, 8 * s.mt)));
  const auto* x = static_cast<const __nv_bfloat16*>(a.hidden);
  const auto* w = static_cast<const __nv_bfloat16*>(a.weight);
#define LOWBIT_DENSE_GATE(MT, CPW, ET)                                                                               \
  if (s.mt == MT && s.cpw == CPW && s.et == ET) {                                                                    \
    dense_gate_kernel<MT, CPW, ET>                                                                                   \
        <<<grid, kGateWarps * 32, 0, stream>>>(x, w, a.tokens, a.experts, a.hidden_size, a.partial);                 \
    return cudaGetLastError();                                                                                       \
  }
  LOWBIT_DENSE_GATE(1, 2, 1)
  LOWBIT_DENSE_GATE(2, 2, 1)
  LOWBIT_DENSE_GATE(4, 2, 1)
  LOWBIT_DENSE_GATE(4, 2, 2)
#undef LOWBIT_DENSE_GATE
  return cudaErrorInvalidValue;  // gate_shape gave a shape without an instance
}

cudaError_t route_cuda(const RouteArgs& a, cudaStream_t stream) {
  if (a.tokens == 0) return cudaSuccess;
  if (a.logit_splits != 1 && a.logits_dtype != DType::kFloat32) return cudaErrorInvalidValue;
  return a.logits_dtype == DType::kBFloat16 ? route_typed<__nv_bfloat16>(a, stream) : route_typed<float>(a, stream);
}

cudaError_t hash_route_cuda(const HashRouteArgs& a, cudaStream_t stream) {
  if (a.tokens == 0) return cudaSuccess;
  return a.token_ids_64 ? hash_typed<int64_t>(a, stream) : hash_typed<int32_t>(a, stream);
}

}  // namespace lowbit::routing
