// CPU reference kernels of the MoE routers: straight loops over the rule in
// routing.h, the ground truth the CUDA kernels are checked against.
#include <algorithm>
#include <vector>

#include "lowbit/format/float_convert.h"
#include "lowbit/routing/routing.h"

namespace lowbit::routing {
namespace {

float load_logit(const void* base, DType dtype, int64_t i) {
  return dtype == DType::kBFloat16 ? bf16_bits_to_float(static_cast<const uint16_t*>(base)[i])
                                   : static_cast<const float*>(base)[i];
}

// Index of the best element of `v` among those with keep[i], excluding the
// elements already taken (those that beat or equal the previous pick).
int32_t best_after(const std::vector<float>& v, const std::vector<char>& keep, float last_v, int32_t last_i) {
  int32_t best = -1;
  for (int32_t i = 0; i < static_cast<int32_t>(v.size()); ++i) {
    if (!keep[i]) continue;
    if (last_i >= 0 && !beats(last_v, last_i, v[i], i)) continue;
    if (best < 0 || beats(v[i], i, v[best], best)) best = i;
  }
  return best;
}

void finish_weights(float* w, int32_t k, bool renormalize, float scale) {
  if (renormalize) {
    // Summed in double so that the reference's only float32 roundings are the
    // final sum and the division (k can be large).
    double sum = 0.0;
    for (int32_t j = 0; j < k; ++j) sum += w[j];
    const float denom = static_cast<float>(sum) + kRenormEpsilon;
    for (int32_t j = 0; j < k; ++j) w[j] /= denom;
  }
  for (int32_t j = 0; j < k; ++j) w[j] *= scale;
}

}  // namespace

int64_t route_workspace_floats(const RouteArgs& a) {
  const bool fast = a.experts <= kFastMaxExperts && a.topk <= kFastMaxTopK;
  return fast ? 0 : a.tokens * 2 * a.experts;
}

void route_cpu(const RouteArgs& a) {
  const int64_t E = a.experts;
  std::vector<float> s(E), biased(E);
  std::vector<char> keep(E);
  const int64_t group_size = E / a.n_group;
  for (int64_t m = 0; m < a.tokens; ++m) {
    for (int64_t e = 0; e < E; ++e) {
      const float x = load_logit(a.logits, a.logits_dtype, m * E + e);
      s[e] = a.score_func == ScoreFunc::kSoftmax ? x : elementwise_score(a.score_func, x);
    }
    if (a.score_func == ScoreFunc::kSoftmax) {
      float mx = s[0];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, s[e]);
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) {
        s[e] = expf(s[e] - mx);
        sum += s[e];
      }
      const float total = static_cast<float>(sum);
      for (int64_t e = 0; e < E; ++e) s[e] /= total;
    }
    for (int64_t e = 0; e < E; ++e) biased[e] = selection_value(a.bias ? s[e] + a.bias[e] : s[e]);

    std::fill(keep.begin(), keep.end(), 1);
    if (a.n_group > 1) {
      std::vector<float> group_score(a.n_group);
      std::vector<char> all(a.n_group, 1);
      for (int32_t g = 0; g < a.n_group; ++g) {
        std::vector<float> v(biased.begin() + g * group_size, biased.begin() + (g + 1) * group_size);
        std::vector<char> every(v.size(), 1);
        const int32_t first = best_after(v, every, 0.f, -1);
        float score = v[first];
        if (group_size > 1) score += v[best_after(v, every, v[first], first)];
        group_score[g] = selection_value(score);
      }
      std::vector<char> chosen(a.n_group, 0);
      float last_v = 0.f;
      int32_t last_i = -1;
      for (int32_t j = 0; j < a.topk_group; ++j) {
        last_i = best_after(group_score, all, last_v, last_i);
        last_v = group_score[last_i];
        chosen[last_i] = 1;
      }
      for (int64_t e = 0; e < E; ++e) keep[e] = chosen[e / group_size];
    }

    float* w = a.weights + m * a.topk;
    int32_t* ids = a.ids + m * a.topk;
    float last_v = 0.f;
    int32_t last_i = -1;
    for (int32_t j = 0; j < a.topk; ++j) {
      last_i = best_after(biased, keep, last_v, last_i);
      last_v = biased[last_i];
      ids[j] = last_i;
      w[j] = s[last_i];
    }
    finish_weights(w, a.topk, a.renormalize, a.routed_scaling_factor);
  }
}

int64_t hash_route_cpu(const HashRouteArgs& a) {
  for (int64_t m = 0; m < a.tokens; ++m) {
    const int64_t tid = a.token_ids_64 ? static_cast<const int64_t*>(a.token_ids)[m]
                                       : static_cast<const int32_t*>(a.token_ids)[m];
    if (tid < 0 || tid >= a.vocab) return m;
    const int32_t* row = a.table + tid * a.topk;
    float* w = a.weights + m * a.topk;
    int32_t* ids = a.ids + m * a.topk;
    for (int32_t j = 0; j < a.topk; ++j) {
      const int32_t e = row[j];
      if (e < 0 || e >= a.experts) return m;
      ids[j] = e;
      w[j] = a.weighting == HashWeighting::kUniform
                 ? 1.f / static_cast<float>(a.topk)
                 : elementwise_score(a.score_func, load_logit(a.logits, a.logits_dtype, m * a.experts + e));
    }
    if (a.weighting == HashWeighting::kGate)
      finish_weights(w, a.topk, a.renormalize, a.routed_scaling_factor);
    else
      finish_weights(w, a.topk, false, a.routed_scaling_factor);
  }
  return -1;
}

}  // namespace lowbit::routing
