// Bindings of lowbit::route / dense_router / hash_router / topk: validation,
// option parsing, output allocation, and the CPU and Meta kernels (CUDA in
// routing_ops_cuda.cpp).
#include "routing_ops.h"

#include <torch/library.h>

#include <cmath>
#include <limits>

#include "checks.h"

namespace lowbit::ops {
namespace {

constexpr const char* kRoute = "route";
constexpr const char* kDense = "dense_router";
constexpr const char* kHash = "hash_router";
constexpr const char* kTopk = "topk";

routing::ScoreFunc parse_score_func(const char* op, c10::string_view name, bool allow_softmax) {
  if (name == "sqrtsoftplus") return routing::ScoreFunc::kSqrtSoftplus;
  if (name == "sigmoid") return routing::ScoreFunc::kSigmoid;
  if (name == "softmax" && allow_softmax) return routing::ScoreFunc::kSoftmax;
  TORCH_CHECK_VALUE(false, "lowbit.", op, ": argument 'score_func' must be ",
                    allow_softmax ? "'sqrtsoftplus', 'sigmoid' or 'softmax'" : "'sqrtsoftplus' or 'sigmoid'",
                    ", got '", std::string(name), "'");
}

}  // namespace

RouteOptions check_route(const char* op, const at::Tensor& logits, const c10::optional<at::Tensor>& bias, int64_t k,
                         c10::string_view score_func, int64_t n_group, int64_t topk_group, bool renormalize,
                         double scale) {
  check_dtype(logits, op, "logits", {at::kFloat, at::kBFloat16});
  check_dims(logits, op, "logits", {2});
  const c10::SymInt& experts = logits.sym_size(1);
  TORCH_CHECK_VALUE(experts >= 1, "lowbit.", op, ": argument 'logits' must have at least one expert column, got shape ",
                    logits.sym_sizes());
  TORCH_CHECK_VALUE(experts <= std::numeric_limits<int32_t>::max(), "lowbit.", op,
                    ": argument 'logits' has too many experts: ", experts);
  TORCH_CHECK_VALUE(k >= 1 && experts >= k, "lowbit.", op, ": argument 'k' must be in [1, ", experts, "] (experts), got ",
                    k);
  if (bias.has_value()) {
    check_dtype(*bias, op, "bias", {at::kFloat});
    check_same_device(*bias, logits, op, "bias", "logits");
    check_shape(*bias, {experts}, op, "bias");
  }
  RouteOptions o{k, parse_score_func(op, score_func, true), n_group, topk_group, renormalize, scale};
  TORCH_CHECK_VALUE(n_group >= 1 && n_group <= routing::kMaxGroups, "lowbit.", op, ": argument 'n_group' must be in [1, ",
                    routing::kMaxGroups, "], got ", n_group);
  TORCH_CHECK_VALUE(experts % n_group == 0, "lowbit.", op, ": argument 'n_group' must divide the number of experts (",
                    experts, "), got ", n_group);
  TORCH_CHECK_VALUE(topk_group >= 1 && topk_group <= n_group, "lowbit.", op, ": argument 'topk_group' must be in [1, ",
                    n_group, "] (n_group), got ", topk_group);
  TORCH_CHECK_VALUE((experts / n_group) * topk_group >= k, "lowbit.", op, ": argument 'k' (", k,
                    ") exceeds the experts in the kept groups (topk_group ", topk_group, " x ", experts / n_group, ")");
  TORCH_CHECK_VALUE(std::isfinite(scale), "lowbit.", op, ": argument 'routed_scaling_factor' must be finite, got ",
                    scale);
  return o;
}

void check_dense_router(const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_dtype(hidden, kDense, "hidden", {at::kBFloat16, at::kFloat});
  check_dims(hidden, kDense, "hidden", {2});
  check_dtype(weight, kDense, "weight", {hidden.scalar_type()});
  check_dims(weight, kDense, "weight", {2});
  check_same_device(weight, hidden, kDense, "weight", "hidden");
  if (bias.has_value()) check_same_device(*bias, hidden, kDense, "bias", "hidden");
  TORCH_CHECK_VALUE(weight.sym_size(1) == hidden.sym_size(1), "lowbit.", kDense,
                    ": argument 'weight' must have shape [E, ", hidden.sym_size(1), "] (H of 'hidden'), got ",
                    weight.sym_sizes());
}

RouteOut empty_route_outputs(const at::Tensor& like, const c10::SymInt& tokens, const c10::SymInt& k) {
  return {at::empty_symint({tokens, k}, like.options().dtype(at::kFloat)),
          at::empty_symint({tokens, k}, like.options().dtype(at::kInt))};
}

routing::RouteArgs route_args(const at::Tensor& logits, const c10::optional<at::Tensor>& bias, const RouteOptions& o,
                              RouteOut& out) {
  routing::RouteArgs a{};
  a.logits = logits.data_ptr();
  a.logits_dtype = to_lowbit_dtype(logits.scalar_type());
  a.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  a.tokens = logits.size(0);
  a.experts = logits.size(1);
  a.topk = static_cast<int32_t>(o.k);
  a.score_func = o.score_func;
  a.n_group = static_cast<int32_t>(o.n_group);
  a.topk_group = static_cast<int32_t>(o.topk_group);
  a.renormalize = o.renormalize;
  a.routed_scaling_factor = static_cast<float>(o.scale);
  a.weights = std::get<0>(out).data_ptr<float>();
  a.ids = std::get<1>(out).data_ptr<int32_t>();
  return a;
}

int64_t hash_experts(const HashOptions& o, const c10::optional<at::Tensor>& logits) {
  return logits.has_value() ? logits->size(1) : o.experts;
}

HashOptions check_hash_router(const at::Tensor& token_ids, const at::Tensor& tid2eid,
                              const c10::optional<at::Tensor>& logits, c10::string_view score_func,
                              c10::string_view weighting, double scale, c10::optional<int64_t> n_experts) {
  check_dtype(token_ids, kHash, "token_ids", {at::kLong, at::kInt});
  check_dims(token_ids, kHash, "token_ids", {1});
  check_dtype(tid2eid, kHash, "tid2eid", {at::kInt});
  check_dims(tid2eid, kHash, "tid2eid", {2});
  check_same_device(tid2eid, token_ids, kHash, "tid2eid", "token_ids");
  TORCH_CHECK_VALUE(tid2eid.sym_size(1) >= 1, "lowbit.", kHash, ": argument 'tid2eid' must have k >= 1 columns, got shape ",
                    tid2eid.sym_sizes());
  HashOptions o{parse_score_func(kHash, score_func, false), routing::HashWeighting::kGate, 0};
  if (weighting == "uniform") {
    o.weighting = routing::HashWeighting::kUniform;
  } else {
    TORCH_CHECK_VALUE(weighting == "gate", "lowbit.", kHash, ": argument 'weighting' must be 'gate' or 'uniform', got '",
                      std::string(weighting), "'");
    TORCH_CHECK_VALUE(logits.has_value(), "lowbit.", kHash,
                      ": argument 'logits' is required with weighting='gate' (the gate's scores weight the experts)");
  }
  if (logits.has_value()) {
    check_dtype(*logits, kHash, "logits", {at::kFloat, at::kBFloat16});
    check_dims(*logits, kHash, "logits", {2});
    check_same_device(*logits, token_ids, kHash, "logits", "token_ids");
    TORCH_CHECK_VALUE(logits->sym_size(0) == token_ids.sym_size(0), "lowbit.", kHash,
                      ": argument 'logits' must have shape [", token_ids.sym_size(0), ", E] (M of 'token_ids'), got ",
                      logits->sym_sizes());
  }
  // E bounds the table's entries; the ids are checked against it (on the
  // GPU in the kernel or after it, without reading them on the host).
  if (n_experts.has_value()) {
    TORCH_CHECK_VALUE(*n_experts >= 1 && *n_experts <= std::numeric_limits<int32_t>::max(), "lowbit.", kHash,
                      ": argument 'n_experts' must be in [1, ", std::numeric_limits<int32_t>::max(), "], got ",
                      *n_experts);
    if (logits.has_value())
      TORCH_CHECK_VALUE(logits->sym_size(1) == *n_experts, "lowbit.", kHash, ": argument 'n_experts' (", *n_experts,
                        ") must equal the experts of 'logits' (", logits->sym_size(1), "), got shape ",
                        logits->sym_sizes());
    o.experts = *n_experts;
  } else {
    TORCH_CHECK_VALUE(logits.has_value(), "lowbit.", kHash,
                      ": argument 'n_experts' is required with weighting='uniform' and no 'logits' (the table's "
                      "expert ids are checked against it)");
  }
  TORCH_CHECK_VALUE(std::isfinite(scale), "lowbit.", kHash, ": argument 'routed_scaling_factor' must be finite, got ",
                    scale);
  return o;
}

routing::HashRouteArgs hash_args(const at::Tensor& token_ids, const at::Tensor& tid2eid,
                                 const c10::optional<at::Tensor>& logits, const HashOptions& o, bool renormalize,
                                 double scale, RouteOut& out) {
  routing::HashRouteArgs a{};
  a.token_ids = token_ids.data_ptr();
  a.token_ids_64 = token_ids.scalar_type() == at::kLong;
  a.table = tid2eid.data_ptr<int32_t>();
  a.vocab = tid2eid.size(0);
  a.tokens = token_ids.size(0);
  a.topk = static_cast<int32_t>(tid2eid.size(1));
  a.score_func = o.score_func;
  a.weighting = o.weighting;
  a.renormalize = renormalize;
  a.routed_scaling_factor = static_cast<float>(scale);
  a.experts = hash_experts(o, logits);
  if (logits.has_value()) {
    a.logits = logits->data_ptr();
    a.logits_dtype = to_lowbit_dtype(logits->scalar_type());
  }
  a.weights = std::get<0>(out).data_ptr<float>();
  a.ids = std::get<1>(out).data_ptr<int32_t>();
  return a;
}

void check_topk(const at::Tensor& input, int64_t k) {
  check_dtype(input, kTopk, "input", {at::kFloat, at::kBFloat16});
  check_dims(input, kTopk, "input", {2});
  const c10::SymInt& cols = input.sym_size(1);
  TORCH_CHECK_VALUE(cols <= topk::kMaxCols, "lowbit.", kTopk, ": argument 'input' rows may be at most ", topk::kMaxCols,
                    " wide, got shape ", input.sym_sizes());
  TORCH_CHECK_VALUE(k >= 1 && k <= topk::kMaxK && cols >= k, "lowbit.", kTopk, ": argument 'k' must be in [1, min(",
                    cols, " (row width), ", topk::kMaxK, ")], got ", k);
}

std::tuple<at::Tensor, at::Tensor> empty_topk_outputs(const at::Tensor& input, int64_t k) {
  return {at::empty_symint({input.sym_size(0), k}, input.options()),
          at::empty_symint({input.sym_size(0), k}, input.options().dtype(at::kInt))};
}

topk::TopkArgs topk_args(const at::Tensor& input, int64_t k, std::tuple<at::Tensor, at::Tensor>& out) {
  topk::TopkArgs a{};
  a.input = input.data_ptr();
  a.input_dtype = to_lowbit_dtype(input.scalar_type());
  a.rows = input.size(0);
  a.cols = input.size(1);
  a.k = static_cast<int32_t>(k);
  a.values = std::get<0>(out).data_ptr();
  a.indices = std::get<1>(out).data_ptr<int32_t>();
  return a;
}

namespace {

// `op` names the op the caller called (route, or dense_router on its logits).
RouteOut route_cpu_as(const char* op, const at::Tensor& logits, const c10::optional<at::Tensor>& bias, int64_t k,
                      c10::string_view score_func, int64_t n_group, int64_t topk_group, bool renormalize,
                      double scale) {
  auto o = check_route(op, logits, bias, k, score_func, n_group, topk_group, renormalize, scale);
  auto x = logits.contiguous();
  c10::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->contiguous();
  auto out = empty_route_outputs(x, x.sym_size(0), k);
  routing::route_cpu(route_args(x, b, o, out));
  return out;
}

RouteOut route_cpu(const at::Tensor& logits, const c10::optional<at::Tensor>& bias, int64_t k,
                   c10::string_view score_func, int64_t n_group, int64_t topk_group, bool renormalize, double scale) {
  return route_cpu_as(kRoute, logits, bias, k, score_func, n_group, topk_group, renormalize, scale);
}

RouteOut route_meta_as(const char* op, const at::Tensor& logits, const c10::optional<at::Tensor>& bias, int64_t k,
                       c10::string_view score_func, int64_t n_group, int64_t topk_group, bool renormalize,
                       double scale) {
  check_route(op, logits, bias, k, score_func, n_group, topk_group, renormalize, scale);
  return empty_route_outputs(logits, logits.sym_size(0), k);
}

RouteOut route_meta(const at::Tensor& logits, const c10::optional<at::Tensor>& bias, int64_t k,
                    c10::string_view score_func, int64_t n_group, int64_t topk_group, bool renormalize, double scale) {
  return route_meta_as(kRoute, logits, bias, k, score_func, n_group, topk_group, renormalize, scale);
}

RouteOut dense_router_cpu(const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                          int64_t k, c10::string_view score_func, int64_t n_group, int64_t topk_group,
                          bool renormalize, double scale) {
  check_dense_router(hidden, weight, bias);
  // Gate logits in float32 (products of bf16 values are exact in float32).
  auto logits = at::matmul(hidden.to(at::kFloat), weight.to(at::kFloat).t()).contiguous();
  return route_cpu_as(kDense, logits, bias, k, score_func, n_group, topk_group, renormalize, scale);
}

RouteOut dense_router_meta(const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           int64_t k, c10::string_view score_func, int64_t n_group, int64_t topk_group,
                           bool renormalize, double scale) {
  check_dense_router(hidden, weight, bias);
  auto logits = at::empty_symint({hidden.sym_size(0), weight.sym_size(0)}, hidden.options().dtype(at::kFloat));
  return route_meta_as(kDense, logits, bias, k, score_func, n_group, topk_group, renormalize, scale);
}

RouteOut hash_router_cpu(const at::Tensor& token_ids, const at::Tensor& tid2eid, const c10::optional<at::Tensor>& logits,
                         c10::string_view score_func, c10::string_view weighting, bool renormalize, double scale,
                         c10::optional<int64_t> n_experts) {
  auto o = check_hash_router(token_ids, tid2eid, logits, score_func, weighting, scale, n_experts);
  auto ids = token_ids.contiguous();
  auto table = tid2eid.contiguous();
  c10::optional<at::Tensor> x;
  if (logits.has_value()) x = logits->contiguous();
  auto out = empty_route_outputs(ids, ids.sym_size(0), table.sym_size(1));
  int64_t bad = routing::hash_route_cpu(hash_args(ids, table, x, o, renormalize, scale, out));
  if (bad >= 0) {
    const int64_t tid = ids.scalar_type() == at::kLong ? ids.data_ptr<int64_t>()[bad] : ids.data_ptr<int32_t>()[bad];
    TORCH_CHECK_VALUE(tid >= 0 && tid < table.size(0), "lowbit.", kHash, ": argument 'token_ids' holds ", tid,
                      " at position ", bad, ", outside the table's vocabulary [0, ", table.size(0), ")");
    TORCH_CHECK_VALUE(false, "lowbit.", kHash, ": argument 'tid2eid' row ", tid, " (token_ids position ", bad,
                      ") holds an expert id outside [0, ", hash_experts(o, x), ")");
  }
  return out;
}

RouteOut hash_router_meta(const at::Tensor& token_ids, const at::Tensor& tid2eid,
                          const c10::optional<at::Tensor>& logits, c10::string_view score_func,
                          c10::string_view weighting, bool renormalize, double scale,
                          c10::optional<int64_t> n_experts) {
  check_hash_router(token_ids, tid2eid, logits, score_func, weighting, scale, n_experts);
  return empty_route_outputs(token_ids, token_ids.sym_size(0), tid2eid.sym_size(1));
}

std::tuple<at::Tensor, at::Tensor> topk_cpu(const at::Tensor& input, int64_t k) {
  check_topk(input, k);
  auto x = input.contiguous();
  auto out = empty_topk_outputs(x, k);
  topk::topk_cpu(topk_args(x, k, out));
  return out;
}

std::tuple<at::Tensor, at::Tensor> topk_meta(const at::Tensor& input, int64_t k) {
  check_topk(input, k);
  return empty_topk_outputs(input, k);
}

}  // namespace
}  // namespace lowbit::ops

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("route", &lowbit::ops::route_cpu);
  m.impl("dense_router", &lowbit::ops::dense_router_cpu);
  m.impl("hash_router", &lowbit::ops::hash_router_cpu);
  m.impl("topk", &lowbit::ops::topk_cpu);
}

TORCH_LIBRARY_IMPL(lowbit, Meta, m) {
  m.impl("route", &lowbit::ops::route_meta);
  m.impl("dense_router", &lowbit::ops::dense_router_meta);
  m.impl("hash_router", &lowbit::ops::hash_router_meta);
  m.impl("topk", &lowbit::ops::topk_meta);
}
