// CUDA kernels of lowbit::route / dense_router / hash_router / topk: thin
// adapters from at::Tensor to the core launchers (routing.cu, topk.cu).
// Workspaces come from the caching allocator, so every op is CUDA-graph safe.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda_checks.h"
#include "routing_ops.h"

namespace lowbit::ops {
namespace {

// Routes float32 / bf16 logits [M, E] (or, with logit_splits > 1, the gate's
// float32 partials [logit_splits, M, E], whose first split `logits` is).
RouteOut launch_route(const at::Tensor& logits, const c10::optional<at::Tensor>& bias, const RouteOptions& o,
                      int32_t logit_splits = 1, bool after_gate = false) {
  c10::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->contiguous();
  auto out = empty_route_outputs(logits, logits.sym_size(0), o.k);
  auto args = route_args(logits, b, o, out);
  args.logit_splits = logit_splits;
  args.after_gate = after_gate;
  at::Tensor workspace;
  const int64_t ws = routing::route_workspace_floats(args);
  if (ws > 0) {
    workspace = at::empty({ws}, logits.options().dtype(at::kFloat));
    args.workspace = workspace.data_ptr<float>();
  }
  C10_CUDA_CHECK(routing::route_cuda(args, c10::cuda::getCurrentCUDAStream()));
  return out;
}

RouteOut route_cuda(const at::Tensor& logits, const c10::optional<at::Tensor>& bias, int64_t k,
                    c10::string_view score_func, int64_t n_group, int64_t topk_group, bool renormalize, double scale) {
  check_supported_gpu(logits, "route");
  auto o = check_route("route", logits, bias, k, score_func, n_group, topk_group, renormalize, scale);
  c10::cuda::CUDAGuard guard(logits.device());
  return launch_route(logits.contiguous(), bias, o);
}

RouteOut dense_router_cuda(const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           int64_t k, c10::string_view score_func, int64_t n_group, int64_t topk_group,
                           bool renormalize, double scale) {
  check_supported_gpu(hidden, "dense_router");
  check_dense_router(hidden, weight, bias);
  c10::cuda::CUDAGuard guard(hidden.device());
  // Small M, bf16, aligned, route's fast path: lowbit's split-K tensor-core
  // gate GEMM, its float32 partial sums added in split order by the routing
  // kernel, launched as the gate's dependent (deterministic; docs/perf/log/routing.md,
  // dense_router v3). Otherwise cuBLAS with float32 output, then route.
  const int64_t tokens = hidden.size(0), experts = weight.size(0), hidden_size = hidden.size(1);
  if (hidden.scalar_type() == at::kBFloat16 && routing::dense_gate_supported(tokens, experts, hidden_size) &&
      experts <= routing::kFastMaxExperts && k <= routing::kFastMaxTopK) {
    auto x = hidden.contiguous();
    auto w = weight.contiguous();
    if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0) {
      const int32_t splits = routing::dense_gate_splits(tokens, experts, hidden_size);
      auto partial = at::empty({splits, tokens, experts}, x.options().dtype(at::kFloat));
      auto o = check_route("dense_router", partial[0], bias, k, score_func, n_group, topk_group, renormalize, scale);
      const routing::DenseGateArgs gate{x.data_ptr(), w.data_ptr(), tokens, experts, hidden_size, splits,
                                        partial.data_ptr<float>()};
      C10_CUDA_CHECK(routing::dense_gate_cuda(gate, c10::cuda::getCurrentCUDAStream()));
      return launch_route(partial[0], bias, o, splits, /*after_gate=*/true);
    }
  }
  auto logits = hidden.scalar_type() == at::kBFloat16 ? at::mm(hidden, weight.t(), at::kFloat)
                                                      : at::mm(hidden, weight.t());
  auto o = check_route("dense_router", logits, bias, k, score_func, n_group, topk_group, renormalize, scale);
  return launch_route(logits, bias, o);
}

RouteOut hash_router_cuda(const at::Tensor& token_ids, const at::Tensor& tid2eid,
                          const c10::optional<at::Tensor>& logits, c10::string_view score_func,
                          c10::string_view weighting, bool renormalize, double scale,
                          c10::optional<int64_t> n_experts) {
  check_supported_gpu(token_ids, "hash_router");
  auto o = check_hash_router(token_ids, tid2eid, logits, score_func, weighting, scale, n_experts);
  c10::cuda::CUDAGuard guard(token_ids.device());
  auto ids = token_ids.contiguous();
  auto table = tid2eid.contiguous();
  c10::optional<at::Tensor> x;
  if (logits.has_value()) x = logits->contiguous();
  auto out = empty_route_outputs(ids, ids.sym_size(0), table.sym_size(1));
  C10_CUDA_CHECK(routing::hash_route_cuda(hash_args(ids, table, x, o, renormalize, scale, out),
                                          c10::cuda::getCurrentCUDAStream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> topk_cuda(const at::Tensor& input, int64_t k) {
  check_supported_gpu(input, "topk");
  check_topk(input, k);
  c10::cuda::CUDAGuard guard(input.device());
  auto x = input.contiguous();
  auto out = empty_topk_outputs(x, k);
  auto args = topk_args(x, k, out);
  auto workspace = at::empty({std::max<int64_t>(1, topk::topk_workspace_words(args))}, x.options().dtype(at::kInt));
  args.workspace = reinterpret_cast<uint32_t*>(workspace.data_ptr<int32_t>());
  C10_CUDA_CHECK(topk::topk_cuda(args, c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace lowbit::ops

TORCH_LIBRARY_IMPL(lowbit, CUDA, m) {
  m.impl("route", &lowbit::ops::route_cuda);
  m.impl("dense_router", &lowbit::ops::dense_router_cuda);
  m.impl("hash_router", &lowbit::ops::hash_router_cuda);
  m.impl("topk", &lowbit::ops::topk_cuda);
}
