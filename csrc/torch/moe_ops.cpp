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
constexpr const char* kMoeToFp8 = "nvfp4_moe_to_fp8";

void check_stacked(const at::Tensor& t, const char* op, const char* arg, std::initializer_list<at::ScalarType> dtypes) {
  check_dtype(t, op, arg, dtypes);
  check_dims(t, op, arg, {3});
}

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

// The prepacked experts for hidden size h: w13 [E, 2I, Hp/2], w13_scale
// [E, 2I, Hp/16], w13_global float32 [E], w2 [E, H, Ip/2], w2_scale
// [E, H, Ip/16], w2_global [E]; I a positive multiple of 16.
void check_moe_weights(const char* op, const c10::SymInt& h, const at::Tensor& w13, const at::Tensor& w13_scale,
                       const at::Tensor& w13_global, const at::Tensor& w2, const at::Tensor& w2_scale,
                       const at::Tensor& w2_global) {
  check_stacked(w13, op, "w13", {at::kByte});
  check_stacked(w13_scale, op, "w13_scale", {at::kByte});
  check_stacked(w2, op, "w2", {at::kByte});
  check_stacked(w2_scale, op, "w2_scale", {at::kByte});
  check_dtype(w13_global, op, "w13_global", {at::kFloat});
  check_dtype(w2_global, op, "w2_global", {at::kFloat});
  const c10::SymInt& e = w13.sym_size(0);
  const c10::SymInt& two_i = w13.sym_size(1);
  TORCH_CHECK_VALUE(e >= 1, "lowbit.", op, ": argument 'w13' must hold at least one expert, got shape ",
                    w13.sym_sizes());
  TORCH_CHECK_VALUE(two_i % 32 == 0 && two_i > 0, "lowbit.", op,
                    ": argument 'w13' must have 2 * I rows per expert with I a positive multiple of 16, got shape ",
                    w13.sym_sizes());
  const c10::SymInt inter = two_i / 2;
  const c10::SymInt hp = padded_k_sym(h), ip = padded_k_sym(inter);
  TORCH_CHECK_VALUE(w13.sym_size(2) == hp / 2, "lowbit.", op,
                    ": argument 'w13' must be prepacked (lowbit.nvfp4_moe_prepack) for H = ", h,
                    ", i.e. have shape [E, 2I, ", hp / 2, "], got ", w13.sym_sizes());
  check_shape(w13_scale, c10::SymDimVector{e, two_i, hp / 16}, op, "w13_scale");
  check_shape(w13_global, c10::SymDimVector{e}, op, "w13_global");
  check_shape(w2, c10::SymDimVector{e, h, ip / 2}, op, "w2");
  check_shape(w2_scale, c10::SymDimVector{e, h, ip / 16}, op, "w2_scale");
  check_shape(w2_global, c10::SymDimVector{e}, op, "w2_global");
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
  check_moe_weights(kMoe, x.sym_size(1), w13, w13_scale, w13_global, w2, w2_scale, w2_global);
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

void check_moe_fp8(const at::Tensor& x, const at::Tensor& w13, int64_t fp8_min_rows,
                   const c10::optional<at::Tensor>& w13_fp8, const c10::optional<at::Tensor>& w13_fp8_scale,
                   const c10::optional<at::Tensor>& w2_fp8, const c10::optional<at::Tensor>& w2_fp8_scale) {
  TORCH_CHECK_VALUE(fp8_min_rows >= 0, "lowbit.", kMoe,
                    ": argument 'fp8_min_rows' must be >= 0 (0: never the FP8 path), got ", fp8_min_rows);
  const c10::optional<at::Tensor>* fp8[] = {&w13_fp8, &w13_fp8_scale, &w2_fp8, &w2_fp8_scale};
  const char* names[] = {"w13_fp8", "w13_fp8_scale", "w2_fp8", "w2_fp8_scale"};
  if (fp8_min_rows == 0) {
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK_VALUE(!fp8[i]->has_value(), "lowbit.", kMoe, ": argument '", names[i],
                        "' is used only by the FP8 path, so 'fp8_min_rows' must be > 0 with it");
    }
    return;
  }
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK_VALUE(fp8[i]->has_value(), "lowbit.", kMoe, ": fp8_min_rows = ", fp8_min_rows,
                      " (the FP8 path) needs the experts' FP8 form: argument '", names[i],
                      "' is missing (lowbit.nvfp4_moe_to_fp8 makes all four)");
  }
  const c10::SymInt& e = w13.sym_size(0);
  // torch's grouped FP8 GEMM, which the CUDA kernel runs, takes fewer than
  // 1024 groups; the CPU kernel keeps the same contract.
  TORCH_CHECK_VALUE(e < 1024, "lowbit.", kMoe, ": the FP8 path (fp8_min_rows > 0) takes at most 1023 experts, got ",
                    "'w13' with ", e, "; run such a layer with fp8_min_rows = 0 (compute=\"w4a16\")");
  const c10::SymInt& two_i = w13.sym_size(1);
  const c10::SymInt& h = x.sym_size(1);
  const c10::SymInt inter = two_i / 2;
  check_dtype(*w13_fp8, kMoe, "w13_fp8", {at::kFloat8_e4m3fn, at::kByte});
  check_dtype(*w2_fp8, kMoe, "w2_fp8", {at::kFloat8_e4m3fn, at::kByte});
  check_dtype(*w13_fp8_scale, kMoe, "w13_fp8_scale", {at::kFloat});
  check_dtype(*w2_fp8_scale, kMoe, "w2_fp8_scale", {at::kFloat});
  check_shape(*w13_fp8, c10::SymDimVector{e, two_i, h}, kMoe, "w13_fp8");
  check_shape(*w13_fp8_scale, c10::SymDimVector{e, two_i}, kMoe, "w13_fp8_scale");
  check_shape(*w2_fp8, c10::SymDimVector{e, h, inter}, kMoe, "w2_fp8");
  check_shape(*w2_fp8_scale, c10::SymDimVector{e, h}, kMoe, "w2_fp8_scale");
  for (int i = 0; i < 4; ++i) check_same_device(**fp8[i], x, kMoe, names[i], "x");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_to_fp8(
    const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global, const at::Tensor& w2,
    const at::Tensor& w2_scale, const at::Tensor& w2_global,
    const std::function<void(nvfp4::gemm::Fp8WeightArgs&)>& convert) {
  check_moe_weights(kMoeToFp8, w2.sym_size(1), w13, w13_scale, w13_global, w2, w2_scale, w2_global);
  const at::Tensor* same[] = {&w13_scale, &w13_global, &w2, &w2_scale, &w2_global};
  const char* names[] = {"w13_scale", "w13_global", "w2", "w2_scale", "w2_global"};
  for (int i = 0; i < 5; ++i) check_same_device(*same[i], w13, kMoeToFp8, names[i], "w13");
  const int64_t e = w13.size(0), two_i = w13.size(1), inter = two_i / 2, h = w2.size(1);
  const auto f8 = w13.options().dtype(at::kFloat8_e4m3fn), f32 = w13.options().dtype(at::kFloat);
  at::Tensor c13 = at::empty({e, two_i, h}, f8), r13 = at::empty({e, two_i}, f32);
  at::Tensor c2 = at::empty({e, h, inter}, f8), r2 = at::empty({e, h}, f32);
  auto p13 = contiguous_aligned(w13, 16), s13 = contiguous_aligned(w13_scale, 16), g13 = w13_global.contiguous();
  auto p2 = contiguous_aligned(w2, 16), s2 = contiguous_aligned(w2_scale, 16), g2 = w2_global.contiguous();
  // Expert x of a stacked weight is the Linear's prepacked weight of n rows
  // and k columns at a fixed stride (its scale tiles without the Linear's
  // trailing K record, which the conversion does not read).
  auto run = [&](const at::Tensor& p, const at::Tensor& sc, const at::Tensor& g, at::Tensor& codes,
                 at::Tensor& rows, int64_t n, int64_t k) {
    const int64_t kp = nvfp4::gemm::padded_k(k);
    for (int64_t x = 0; x < e; ++x) {
      nvfp4::gemm::Fp8WeightArgs a{};
      a.weight = p.data_ptr<uint8_t>() + x * n * (kp / 2);
      a.scale = sc.data_ptr<uint8_t>() + x * n * (kp / 16);
      a.global_scale = g.data_ptr<float>() + x;
      a.n = n;
      a.k = k;
      a.out = reinterpret_cast<uint8_t*>(codes.data_ptr()) + x * n * k;
      a.row_scale = rows.data_ptr<float>() + x * n;
      convert(a);
    }
  };
  run(p13, s13, g13, c13, r13, two_i, h);
  run(p2, s2, g2, c2, r2, h, inter);
  return {deinterleave_w13(c13.view({e, two_i, h})).view({e, two_i, h}),
          deinterleave_w13(r13.view({e, two_i, 1})).view({e, two_i}), c2, r2};
}

namespace {

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

// The FP8 path's reference (nvfp4_moe.h, "The FP8 path") in ATen ops on the
// CPU: x's rows and the activations rounded by the core's loops, each
// expert's GEMMs as FP32 sums of E4M3 products times the row scales,
// rounded to BF16 as the grouped GEMMs round; the combine in FP32 in slot
// order, rounded once to x's dtype. Ids are in [0, E) (checked).
at::Tensor moe_fp8_cpu(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                       const at::Tensor& w13_fp8, const at::Tensor& w13_fp8_scale, const at::Tensor& w2_fp8,
                       const at::Tensor& w2_fp8_scale, c10::optional<double> swiglu_limit) {
  const int64_t m = x.size(0), h = x.size(1), k = topk_ids.size(1), experts = w13_fp8.size(0);
  const int64_t inter = w13_fp8.size(1) / 2;
  const auto f32 = x.options().dtype(at::kFloat);
  auto [x8, x_scale] = fp8_rows_cpu_impl(x.contiguous());
  auto bf16_round = [](const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kFloat); };
  at::Tensor ids = topk_ids.reshape({-1});
  at::Tensor y = at::zeros({m * k, h}, f32);  // per (token, slot) pair
  for (int64_t e = 0; e < experts; ++e) {
    at::Tensor pairs = (ids == e).nonzero().squeeze(1);
    if (pairs.numel() == 0) continue;
    at::Tensor tokens = at::floor_divide(pairs, k);
    at::Tensor xe = x8.index_select(0, tokens).to(at::kFloat);
    at::Tensor gu = at::matmul(xe, fp8_codes(w13_fp8[e]).to(at::kFloat).t());
    gu = bf16_round(gu * x_scale.index_select(0, tokens).unsqueeze(1) * w13_fp8_scale[e].unsqueeze(0));
    at::Tensor gate = gu.slice(1, 0, inter), up = gu.slice(1, inter, 2 * inter);
    if (swiglu_limit.has_value()) {
      const double limit = *swiglu_limit;
      gate = at::clamp_max(gate, limit);
      up = at::clamp(up, -limit, limit);
    }
    at::Tensor act = (gate / (at::exp(-gate) + 1.0) * up).contiguous();
    auto [a8, a_scale] = fp8_rows_cpu_impl(act);
    at::Tensor ye = at::matmul(a8.to(at::kFloat), fp8_codes(w2_fp8[e]).to(at::kFloat).t());
    y.index_copy_(0, pairs, bf16_round(ye * a_scale.unsqueeze(1) * w2_fp8_scale[e].unsqueeze(0)));
  }
  at::Tensor acc = at::zeros({m, h}, f32), y3 = y.view({m, k, h});
  for (int64_t j = 0; j < k; ++j) acc.add_(y3.select(1, j) * topk_weights.select(1, j).unsqueeze(1));
  return acc.to(x.scalar_type());
}

at::Tensor moe_cpu(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                   const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                   const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                   c10::optional<double> swiglu_limit, int64_t fp8_min_rows,
                   const c10::optional<at::Tensor>& w13_fp8, const c10::optional<at::Tensor>& w13_fp8_scale,
                   const c10::optional<at::Tensor>& w2_fp8, const c10::optional<at::Tensor>& w2_fp8_scale) {
  check_moe(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit, false);
  check_moe_fp8(x, w13, fp8_min_rows, w13_fp8, w13_fp8_scale, w2_fp8, w2_fp8_scale);
  const int64_t experts = w13.size(0);
  at::Tensor ids = topk_ids.contiguous();
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    TORCH_CHECK_VALUE(lo >= 0 && hi < experts, "lowbit.", kMoe, ": argument 'topk_ids' must hold expert ids in [0, ",
                      experts, "), got values in [", lo, ", ", hi, "]");
  }
  if (x.numel() == 0) return at::empty(x.sizes(), x.options());
  auto wts = topk_weights.contiguous();
  if (moe_uses_fp8(x.size(0), fp8_min_rows)) {
    return moe_fp8_cpu(x, wts, ids, w13_fp8->contiguous(), w13_fp8_scale->contiguous(), w2_fp8->contiguous(),
                       w2_fp8_scale->contiguous(), swiglu_limit);
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  auto xc = x.contiguous();
  auto p13 = w13.contiguous(), s13 = w13_scale.contiguous(), g13 = w13_global.contiguous();
  auto p2 = w2.contiguous(), s2 = w2_scale.contiguous(), g2 = w2_global.contiguous();
  nvfp4::moe::moe_cpu(moe_args(xc, wts, ids, p13, s13, g13, p2, s2, g2, swiglu_limit, out));
  return out;
}

at::Tensor moe_meta(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                    const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                    const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                    c10::optional<double> swiglu_limit, int64_t fp8_min_rows,
                    const c10::optional<at::Tensor>& w13_fp8, const c10::optional<at::Tensor>& w13_fp8_scale,
                    const c10::optional<at::Tensor>& w2_fp8, const c10::optional<at::Tensor>& w2_fp8_scale) {
  check_moe(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit, false);
  check_moe_fp8(x, w13, fp8_min_rows, w13_fp8, w13_fp8_scale, w2_fp8, w2_fp8_scale);
  return at::empty_symint(x.sym_sizes(), x.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_to_fp8_cpu(
    const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global, const at::Tensor& w2,
    const at::Tensor& w2_scale, const at::Tensor& w2_global) {
  return moe_to_fp8(w13, w13_scale, w13_global, w2, w2_scale, w2_global,
                    [](nvfp4::gemm::Fp8WeightArgs& a) { nvfp4::gemm::fp8_weight_cpu(a); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_to_fp8_meta(
    const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global, const at::Tensor& w2,
    const at::Tensor& w2_scale, const at::Tensor& w2_global) {
  check_moe_weights(kMoeToFp8, w2.sym_size(1), w13, w13_scale, w13_global, w2, w2_scale, w2_global);
  const c10::SymInt& e = w13.sym_size(0);
  const c10::SymInt& two_i = w13.sym_size(1);
  const c10::SymInt& h = w2.sym_size(1);
  const auto f8 = w13.options().dtype(at::kFloat8_e4m3fn), f32 = w13.options().dtype(at::kFloat);
  return {at::empty_symint(c10::SymDimVector{e, two_i, h}, f8), at::empty_symint(c10::SymDimVector{e, two_i}, f32),
          at::empty_symint(c10::SymDimVector{e, h, two_i / 2}, f8), at::empty_symint(c10::SymDimVector{e, h}, f32)};
}

at::Tensor moe_with_plan_cpu(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                             const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                             const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                             c10::optional<double> swiglu_limit, c10::string_view plan) {
  parse_moe_plan(plan);
  return moe_cpu(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit, 0,
                 {}, {}, {}, {});
}

at::Tensor moe_with_plan_meta(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                              const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                              const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                              c10::optional<double> swiglu_limit, c10::string_view plan) {
  parse_moe_plan(plan);
  return moe_meta(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit, 0,
                  {}, {}, {}, {});
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
  m.impl("nvfp4_moe_to_fp8", &lowbit::ops::moe_to_fp8_cpu);
  m.impl("_nvfp4_moe_with_plan", &lowbit::ops::moe_with_plan_cpu);
}

TORCH_LIBRARY_IMPL(lowbit, Meta, m) {
  m.impl("nvfp4_moe", &lowbit::ops::moe_meta);
  m.impl("nvfp4_moe_to_fp8", &lowbit::ops::moe_to_fp8_meta);
  m.impl("_nvfp4_moe_with_plan", &lowbit::ops::moe_with_plan_meta);
}
