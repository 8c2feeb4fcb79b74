// Shared pieces of the MoE routing and top-k bindings: validation, option
// parsing and output allocation used by the CPU, CUDA and Meta kernels.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

#include "lowbit/routing/routing.h"
#include "lowbit/routing/topk.h"

namespace lowbit::ops {

using RouteOut = std::tuple<at::Tensor, at::Tensor>;  // (weights float32 [M, k], ids int32 [M, k])

struct RouteOptions {
  int64_t k;
  routing::ScoreFunc score_func;
  int64_t n_group, topk_group;
  bool renormalize;
  double scale;
};

// Validates logits [M, E] (and bias [E]) against the options; SymInt-aware.
RouteOptions check_route(const char* op, const at::Tensor& logits, const c10::optional<at::Tensor>& bias, int64_t k,
                         c10::string_view score_func, int64_t n_group, int64_t topk_group, bool renormalize,
                         double scale);
// hidden [M, H], weight [E, H] and bias [E] on hidden's device (the rest of
// the options are check_route's, on the logits).
void check_dense_router(const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
RouteOut empty_route_outputs(const at::Tensor& like, const c10::SymInt& tokens, const c10::SymInt& k);

// Core arguments; logits must be contiguous; pointers of outputs filled in.
routing::RouteArgs route_args(const at::Tensor& logits, const c10::optional<at::Tensor>& bias, const RouteOptions& o,
                              RouteOut& out);

struct HashOptions {
  routing::ScoreFunc score_func;
  routing::HashWeighting weighting;
  int64_t experts;  // n_experts when given (else 0: the width of logits)
};
// E, which the table's entries must lie under: n_experts, or logits' width.
int64_t hash_experts(const HashOptions& o, const c10::optional<at::Tensor>& logits);
HashOptions check_hash_router(const at::Tensor& token_ids, const at::Tensor& tid2eid,
                              const c10::optional<at::Tensor>& logits, c10::string_view score_func,
                              c10::string_view weighting, double scale, c10::optional<int64_t> n_experts);
routing::HashRouteArgs hash_args(const at::Tensor& token_ids, const at::Tensor& tid2eid,
                                 const c10::optional<at::Tensor>& logits, const HashOptions& o, bool renormalize,
                                 double scale, RouteOut& out);

void check_topk(const at::Tensor& input, int64_t k);
std::tuple<at::Tensor, at::Tensor> empty_topk_outputs(const at::Tensor& input, int64_t k);
topk::TopkArgs topk_args(const at::Tensor& input, int64_t k, std::tuple<at::Tensor, at::Tensor>& out);

}  // namespace lowbit::ops
