// CUDA kernel of lowbit::nvfp4_moe: an adapter to the launcher in
// csrc/lowbit/moe/nvfp4_moe.cu. Its workspace (sorted order, work items, h and
// the per-pair expert outputs) comes from the caching allocator, sized from
// the shapes, so the op captures in CUDA graphs with no host synchronization.
// lowbit::_nvfp4_moe_with_plan runs the same with a plan string's overrides.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda_checks.h"
#include "moe_ops.h"

namespace lowbit::ops {
namespace {

// The align kernel keeps one int per expert in shared memory (48 KB).
constexpr int64_t kMaxExperts = 12288;

// The MoE with the choices `overrides` force (none for the public op).
at::Tensor moe_cuda_planned(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                            const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                            const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                            c10::optional<double> swiglu_limit, const nvfp4::moe::MoePlanOverrides& overrides) {
  check_moe(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit, true);
  check_supported_gpu(x, "nvfp4_moe");
  TORCH_CHECK_VALUE(w13.size(0) <= kMaxExperts, "lowbit.nvfp4_moe: argument 'w13' may hold at most ", kMaxExperts,
                    " experts on CUDA, got ", w13.size(0));
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t m = x.size(0), h = x.size(1);
  at::Tensor out = at::empty({m, h}, x.options());
  if (m == 0) return out;
  auto xc = contiguous_aligned(x, 16);
  auto wts = topk_weights.contiguous();
  auto ids = topk_ids.contiguous();
  auto p13 = contiguous_aligned(w13, 16), s13 = contiguous_aligned(w13_scale, 16);
  auto p2 = contiguous_aligned(w2, 16), s2 = contiguous_aligned(w2_scale, 16);
  auto g13 = w13_global.contiguous(), g2 = w2_global.contiguous();
  nvfp4::moe::MoeArgs a = moe_args(xc, wts, ids, p13, s13, g13, p2, s2, g2, swiglu_limit, out);
  TORCH_CHECK_VALUE(nvfp4::moe::moe_max_work_items(a, overrides) <= nvfp4::moe::kMaxWorkItems,
                    "lowbit.nvfp4_moe: M * k = ", m * a.k, " (token, expert) pairs need more than ",
                    nvfp4::moe::kMaxWorkItems, " work items on CUDA; split 'x' into smaller batches");
  at::Tensor workspace =
      at::empty({nvfp4::moe::moe_workspace_bytes(a, overrides)}, x.options().dtype(at::kByte));
  C10_CUDA_CHECK(nvfp4::moe::moe_cuda(a, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream(), overrides));
  return out;
}

at::Tensor moe_cuda(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                    const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                    const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                    c10::optional<double> swiglu_limit) {
  return moe_cuda_planned(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global,
                          swiglu_limit, {});
}

at::Tensor moe_with_plan_cuda(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                              const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                              const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                              c10::optional<double> swiglu_limit, c10::string_view plan) {
  return moe_cuda_planned(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global,
                          swiglu_limit, parse_moe_plan(plan));
}

}  // namespace
}  // namespace lowbit::ops

TORCH_LIBRARY_IMPL(lowbit, CUDA, m) {
  m.impl("nvfp4_moe", &lowbit::ops::moe_cuda);
  m.impl("_nvfp4_moe_with_plan", &lowbit::ops::moe_with_plan_cuda);
}
