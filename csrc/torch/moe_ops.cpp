// Bindings of lowbit::nvfp4_moe_prepack / nvfp4_moe_unprepack / nvfp4_moe:
// validation, the prepack and its inverse (one implementation for every
// device: a row interleave of W13 and the Linear's prepack or unprepack
// through the dispatcher), and the CPU and Meta kernels of the MoE (CUDA in
// moe_ops_cuda.cpp). The CPU kernel runs the core's reference
// (csrc/lowbit/moe/nvfp4_moe_cpu.cpp); so does lowbit::_nvfp4_moe_with_plan's,
// after checking its plan string.
#include "moe_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>

#include "checks.h"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "linear_ops.h"

namespace lowbit::ops {
namespace {

constexpr const char* kMoePrepack = "nvfp4_moe_prepack";
constexpr const char* kMoeUnprepack = "nvfp4_moe_unprepack";
constexpr const char* kMoe = "nvfp4_moe";

void check_stacked(const at::Tensor& t, const char* op, const char* arg, std::initializer_list<at::ScalarType> dtypes) {
  check_dtype(t, op, arg, dtypes);
  check_dims(t, op, arg, {3});
}

}  // namespace

void check_moe(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
               const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
               const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
               c10::optional<double> swiglu_limit, bool cuda) {
  if (cuda) {
    check_dtype(x, kMoe, "x", {at::kBFloat16, at::kHalf});
  } else {
    check_dtype(x, kMoe, "x", {at::kBFloat16, at::kHalf, at::kFloat});
  }
  check_dims(x, kMoe, "x", {2});
  check_last_dim_multiple(x, 16, kMoe, "x");
  check_dtype(topk_weights, kMoe, "topk_weights", {at::kFloat});
  check_dims(topk_weights, kMoe, "topk_weights", {2});
  check_dtype(topk_ids, kMoe, "topk_ids", {at::kInt});
  TORCH_CHECK_VALUE(topk_weights.sym_size(0) == x.sym_size(0), "lowbit.", kMoe,
                    ": argument 'topk_weights' must have one row per row of 'x' (", x.sym_size(0), "), got shape ",
                    topk_weights.sym_sizes());
  check_shape(topk_ids, topk_weights.sym_sizes(), kMoe, "topk_ids");
  check_stacked(w13, kMoe, "w13", {at::kByte});
  check_stacked(w13_scale, kMoe, "w13_scale", {at::kByte});
  check_stacked(w2, kMoe, "w2", {at::kByte});
  check_stacked(w2_scale, kMoe, "w2_scale", {at::kByte});
  check_dtype(w13_global, kMoe, "w13_global", {at::kFloat});
  check_dtype(w2_global, kMoe, "w2_global", {at::kFloat});
  const c10::SymInt& h = x.sym_size(1);
  const c10::SymInt& e = w13.sym_size(0);
  const c10::SymInt& two_i = w13.sym_size(1);
  TORCH_CHECK_VALUE(e >= 1, "lowbit.", kMoe, ": argument 'w13' must hold at least one expert, got shape ",
                    w13.sym_sizes());
  TORCH_CHECK_VALUE(two_i % 32 == 0 && two_i > 0, "lowbit.", kMoe,
                    ": argument 'w13' must have 2 * I rows per expert with I a positive multiple of 16, got shape ",
                    w13.sym_sizes());
  const c10::SymInt inter = two_i / 2;
  const c10::SymInt hp = padded_k_sym(h), ip = padded_k_sym(inter);
  TORCH_CHECK_VALUE(w13.sym_size(2) == hp / 2, "lowbit.", kMoe,
                    ": argument 'w13' must be prepacked (lowbit.nvfp4_moe_prepack) for H = ", h,
                    ", i.e. have shape [E, 2I, ", hp / 2, "], got ", w13.sym_sizes());
  check_shape(w13_scale, c10::SymDimVector{e, two_i, hp / 16}, kMoe, "w13_scale");
  check_shape(w13_global, c10::SymDimVector{e}, kMoe, "w13_global");
  check_shape(w2, c10::SymDimVector{e, h, ip / 2}, kMoe, "w2");
  check_shape(w2_scale, c10::SymDimVector{e, h, ip / 16}, kMoe, "w2_scale");
  check_shape(w2_global, c10::SymDimVector{e}, kMoe, "w2_global");
  if (swiglu_limit.has_value()) {
    TORCH_CHECK_VALUE(*swiglu_limit > 0, "lowbit.", kMoe, ": argument 'swiglu_limit' must be > 0 (or None), got ",
                      *swiglu_limit);
  }
  const at::Tensor* same[] = {&topk_weights, &topk_ids, &w13, &w13_scale, &w13_global, &w2, &w2_scale, &w2_global};
  const char* names[] = {"topk_weights", "topk_ids", "w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global"};
  for (int i = 0; i < 8; ++i) check_same_device(*same[i], x, kMoe, names[i], "x");
  // Checked where the size is known (every real kernel): on a symbolic size
  // the comparison would be a guard, which torch.export cannot express.
  if (const auto slots = topk_ids.sym_numel().maybe_as_int()) {
    TORCH_CHECK_VALUE(*slots < (int64_t(1) << 31), "lowbit.", kMoe,
                      ": M * k must be below 2^31, got topk_ids of shape ", topk_ids.sizes());
  }
}

nvfp4::moe::MoeArgs moe_args(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                             const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                             const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                             c10::optional<double> swiglu_limit, at::Tensor& out) {
  nvfp4::moe::MoeArgs a{};
  a.x = x.data_ptr();
  a.dtype = to_lowbit_dtype(x.scalar_type());
  a.topk_weights = topk_weights.data_ptr<float>();
  a.topk_ids = topk_ids.data_ptr<int32_t>();
  a.w13 = w13.data_ptr<uint8_t>();
  a.w13_scale = w13_scale.data_ptr<uint8_t>();
  a.w13_global = w13_global.data_ptr<float>();
  a.w2 = w2.data_ptr<uint8_t>();
  a.w2_scale = w2_scale.data_ptr<uint8_t>();
  a.w2_global = w2_global.data_ptr<float>();
  a.has_limit = swiglu_limit.has_value();
  a.swiglu_limit = a.has_limit ? static_cast<float>(*swiglu_limit) : 0.f;
  a.out = out.data_ptr();
  a.m = x.size(0);
  a.k = topk_ids.size(1);
  a.e = w13.size(0);
  a.h = x.size(1);
  a.inter = w13.size(1) / 2;
  return a;
}

namespace {

// W13 row order of the prepacked layout (the one place it is defined): per
// 16 rows, gate rows 8 j .. 8 j + 7, then up rows I + 8 j .. I + 8 j + 7.
// Checkpoint [E, 2I, C] (gate rows, then up rows) -> [E * 2I, C] in that order.
at::Tensor interleave_w13(const at::Tensor& t) {
  const int64_t e = t.size(0), two_i = t.size(1), c = t.size(2);
  return t.reshape({e, 2, two_i / 16, 8, c}).permute({0, 2, 1, 3, 4}).reshape({e * two_i, c});
}
// Its inverse: [E, 2I, C] in prepacked order -> [E, 2I, C], gate rows then up rows.
at::Tensor deinterleave_w13(const at::Tensor& t) {
  const int64_t e = t.size(0), two_i = t.size(1), c = t.size(2);
  return t.view({e, two_i / 16, 2, 8, c}).permute({0, 2, 1, 3, 4}).reshape({e, two_i, c});
}

std::tuple<at::Tensor, at::Tensor> unprepack_2d(const at::Tensor& weight, const at::Tensor& scale, int64_t k) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowbit::nvfp4_unprepack", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, c10::SymInt)>();
  return op.call(weight, scale, c10::SymInt(k));
}

std::tuple<at::Tensor, at::Tensor> prepack_2d(const at::Tensor& weight, const at::Tensor& scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowbit::nvfp4_prepack", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&)>();
  return op.call(weight, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_prepack(const at::Tensor& w13,
                                                                       const at::Tensor& w13_scale,
                                                                       const at::Tensor& w2,
                                                                       const at::Tensor& w2_scale) {
  check_stacked(w13, kMoePrepack, "w13", {at::kByte});
  check_stacked(w13_scale, kMoePrepack, "w13_scale", {at::kFloat8_e4m3fn, at::kByte});
  check_stacked(w2, kMoePrepack, "w2", {at::kByte});
  check_stacked(w2_scale, kMoePrepack, "w2_scale", {at::kFloat8_e4m3fn, at::kByte});
  const int64_t e = w13.size(0), two_i = w13.size(1), h = w13.size(2) * 2;
  TORCH_CHECK_VALUE(e >= 1, "lowbit.", kMoePrepack, ": argument 'w13' must hold at least one expert, got shape ",
                    w13.sizes());
  TORCH_CHECK_VALUE(two_i % 32 == 0 && two_i > 0, "lowbit.", kMoePrepack,
                    ": argument 'w13' must be [E, 2I, H/2] with I a positive multiple of 16, got shape ", w13.sizes());
  TORCH_CHECK_VALUE(h % 16 == 0 && h > 0, "lowbit.", kMoePrepack,
                    ": argument 'w13' must be [E, 2I, H/2] with H a positive multiple of 16, got shape ", w13.sizes());
  const int64_t inter = two_i / 2;
  check_shape(w13_scale, c10::SymDimVector{e, two_i, h / 16}, kMoePrepack, "w13_scale");
  check_shape(w2, c10::SymDimVector{e, h, inter / 2}, kMoePrepack, "w2");
  check_shape(w2_scale, c10::SymDimVector{e, h, inter / 16}, kMoePrepack, "w2_scale");
  check_same_device(w13_scale, w13, kMoePrepack, "w13_scale", "w13");
  check_same_device(w2, w13, kMoePrepack, "w2", "w13");
  check_same_device(w2_scale, w13, kMoePrepack, "w2_scale", "w13");
  auto [p13, s13] = prepack_2d(interleave_w13(w13), interleave_w13(w13_scale));
  auto [p2, s2] = prepack_2d(w2.reshape({e * h, inter / 2}), w2_scale.reshape({e * h, inter / 16}));
  // The Linear's prepacked scales end with bytes that record K; the MoE
  // records H and I in w2's shape instead, and its kernels index each
  // expert's tiles by a fixed stride, so it keeps the tiles alone.
  return {p13.view({e, two_i, -1}), prepacked_scale_tiles(s13, h).clone().view({e, two_i, -1}), p2.view({e, h, -1}),
          prepacked_scale_tiles(s2, inter).clone().view({e, h, -1})};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_unprepack(const at::Tensor& w13,
                                                                         const at::Tensor& w13_scale,
                                                                         const at::Tensor& w2,
                                                                         const at::Tensor& w2_scale, int64_t h,
                                                                         int64_t inter) {
  check_stacked(w13, kMoeUnprepack, "w13", {at::kByte});
  check_stacked(w13_scale, kMoeUnprepack, "w13_scale", {at::kByte});
  check_stacked(w2, kMoeUnprepack, "w2", {at::kByte});
  check_stacked(w2_scale, kMoeUnprepack, "w2_scale", {at::kByte});
  TORCH_CHECK_VALUE(h > 0 && h % 16 == 0, "lowbit.", kMoeUnprepack,
                    ": argument 'hidden_size' must be a positive multiple of 16, got ", h);
  TORCH_CHECK_VALUE(inter > 0 && inter % 16 == 0, "lowbit.", kMoeUnprepack,
                    ": argument 'intermediate_size' must be a positive multiple of 16, got ", inter);
  const int64_t e = w13.size(0), hp = nvfp4::gemm::padded_k(h), ip = nvfp4::gemm::padded_k(inter);
  check_shape(w13, c10::SymDimVector{e, 2 * inter, hp / 2}, kMoeUnprepack, "w13");
  check_shape(w13_scale, c10::SymDimVector{e, 2 * inter, hp / 16}, kMoeUnprepack, "w13_scale");
  check_shape(w2, c10::SymDimVector{e, h, ip / 2}, kMoeUnprepack, "w2");
  check_shape(w2_scale, c10::SymDimVector{e, h, ip / 16}, kMoeUnprepack, "w2_scale");
  check_same_device(w13_scale, w13, kMoeUnprepack, "w13_scale", "w13");
  check_same_device(w2, w13, kMoeUnprepack, "w2", "w13");
  check_same_device(w2_scale, w13, kMoeUnprepack, "w2_scale", "w13");
  auto [c13, s13] = unprepack_2d(w13.reshape({e * 2 * inter, hp / 2}), w13_scale.reshape({e * 2 * inter, hp / 16}), h);
  auto [c2, s2] = unprepack_2d(w2.reshape({e * h, ip / 2}), w2_scale.reshape({e * h, ip / 16}), inter);
  return {deinterleave_w13(c13.view({e, 2 * inter, h / 2})), deinterleave_w13(s13.view({e, 2 * inter, h / 16})),
          c2.view({e, h, inter / 2}), s2.view({e, h, inter / 16})};
}

at::Tensor moe_cpu(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                   const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                   const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                   c10::optional<double> swiglu_limit) {
  check_moe(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit, false);
  const int64_t experts = w13.size(0);
  at::Tensor ids = topk_ids.contiguous();
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    TORCH_CHECK_VALUE(lo >= 0 && hi < experts, "lowbit.", kMoe, ": argument 'topk_ids' must hold expert ids in [0, ",
                      experts, "), got values in [", lo, ", ", hi, "]");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  auto xc = x.contiguous(), wts = topk_weights.contiguous();
  auto p13 = w13.contiguous(), s13 = w13_scale.contiguous(), g13 = w13_global.contiguous();
  auto p2 = w2.contiguous(), s2 = w2_scale.contiguous(), g2 = w2_global.contiguous();
  nvfp4::moe::moe_cpu(moe_args(xc, wts, ids, p13, s13, g13, p2, s2, g2, swiglu_limit, out));
  return out;
}

at::Tensor moe_meta(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                    const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                    const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                    c10::optional<double> swiglu_limit) {
  check_moe(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit, false);
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor moe_with_plan_cpu(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                             const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                             const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                             c10::optional<double> swiglu_limit, c10::string_view plan) {
  parse_moe_plan(plan);
  return moe_cpu(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit);
}

at::Tensor moe_with_plan_meta(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                              const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                              const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                              c10::optional<double> swiglu_limit, c10::string_view plan) {
  parse_moe_plan(plan);
  return moe_meta(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit);
}

}  // namespace

nvfp4::moe::MoePlanOverrides parse_moe_plan(c10::string_view plan) {
  try {
    return nvfp4::moe::parse_moe_plan_string(std::string(plan));
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(ValueError, c10::str("lowbit._nvfp4_moe_with_plan: ", e.what()));
  }
}

}  // namespace lowbit::ops

TORCH_LIBRARY_IMPL(lowbit, CompositeExplicitAutograd, m) {
  m.impl("nvfp4_moe_prepack", &lowbit::ops::moe_prepack);
  m.impl("nvfp4_moe_unprepack", &lowbit::ops::moe_unprepack);
}

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("nvfp4_moe", &lowbit::ops::moe_cpu);
  m.impl("_nvfp4_moe_with_plan", &lowbit::ops::moe_with_plan_cpu);
}

TORCH_LIBRARY_IMPL(lowbit, Meta, m) {
  m.impl("nvfp4_moe", &lowbit::ops::moe_meta);
  m.impl("_nvfp4_moe_with_plan", &lowbit::ops::moe_with_plan_meta);
}
