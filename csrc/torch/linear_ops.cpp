// Bindings of lowbit::nvfp4_prepack / nvfp4_unpack / nvfp4_to_fp8 /
// nvfp4_linear: validation and the CPU and Meta kernels (CUDA in
// linear_ops_cuda.cpp). The CPU Linear is the reference: unpack the
// prepacked weight to FP32, an FP32 matmul, the bias added in FP32, the
// result in x's dtype; on the FP8 path, the same on the E4M3-rounded rows
// (the core's reference loops) with their scales. Also the plan strings of
// lowbit::_nvfp4_linear_with_plan (one path on the CPU: checked, then
// unused) and lowbit::_explain_linear_plan.
#include "linear_ops.h"

#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>

#include "checks.h"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"

namespace lowbit::ops {
namespace {

constexpr const char* kPrepack = "nvfp4_prepack";
constexpr const char* kUnpack = "nvfp4_unpack";
constexpr const char* kUnprepack = "nvfp4_unprepack";
constexpr const char* kToFp8 = "nvfp4_to_fp8";
constexpr const char* kLinear = "nvfp4_linear";
constexpr const char* kGrouped = "nvfp4_grouped_linear";
constexpr const char* kLinearWithPlan = "_nvfp4_linear_with_plan";
constexpr const char* kExplain = "explain_plan";

}  // namespace

void check_prepack(const at::Tensor& weight, const at::Tensor& weight_scale) {
  check_dtype(weight, kPrepack, "weight", {at::kByte});
  check_dims(weight, kPrepack, "weight", {2});
  check_dtype(weight_scale, kPrepack, "weight_scale", {at::kFloat8_e4m3fn, at::kByte});
  check_dims(weight_scale, kPrepack, "weight_scale", {2});
  check_same_device(weight_scale, weight, kPrepack, "weight_scale", "weight");
  TORCH_CHECK_VALUE(weight.sym_size(0) % nvfp4::gemm::kTileN == 0, "lowbit.", kPrepack,
                    ": argument 'weight' must have a first dimension (N) divisible by 16, got shape ",
                    weight.sym_sizes());
  check_last_dim_multiple(weight, nvfp4::kBlockSize / 2, kPrepack, "weight");
  const c10::SymInt k = weight.sym_size(1) * 2;
  check_shape(weight_scale, c10::SymDimVector{weight.sym_size(0), k / nvfp4::kBlockSize}, kPrepack, "weight_scale");
}

std::tuple<at::Tensor, at::Tensor> empty_prepack_outputs(const at::Tensor& weight) {
  const c10::SymInt k = weight.sym_size(1) * 2;
  const c10::SymInt kp = padded_k_sym(k);
  auto opts = weight.options().dtype(at::kByte);
  at::Tensor w = at::empty_symint(c10::SymDimVector{weight.sym_size(0), kp / 2}, opts);
  at::Tensor s = at::empty_symint(c10::SymDimVector{weight.sym_size(0), prepacked_scale_cols_sym(k)}, opts);
  if (!s.is_meta()) {
    // The bytes after the tiles, which record K: the padding scale (1.0).
    const int64_t tiles_bytes = weight.size(0) * (nvfp4::gemm::padded_k(k.expect_int()) / nvfp4::kBlockSize);
    at::Tensor tail = s.view(-1).narrow(0, tiles_bytes, s.numel() - tiles_bytes);
    if (tail.numel() > 0) tail.fill_(static_cast<int64_t>(nvfp4::gemm::encode_scale(0x38).byte));
  }
  return {w, s};
}

at::Tensor prepacked_scale_tiles(const at::Tensor& weight_scale, const c10::SymInt& k) {
  const c10::SymInt cols = padded_k_sym(k) / nvfp4::kBlockSize;
  return weight_scale.view_symint(c10::SymDimVector{-1})
      .narrow_symint(0, 0, weight_scale.sym_size(0) * cols)
      .view_symint(c10::SymDimVector{weight_scale.sym_size(0), cols});
}

nvfp4::gemm::PrepackArgs prepack_args(const at::Tensor& weight, const at::Tensor& weight_scale,
                                      std::tuple<at::Tensor, at::Tensor>& out) {
  nvfp4::gemm::PrepackArgs a{};
  a.codes = weight.data_ptr<uint8_t>();
  a.block_scale = reinterpret_cast<const uint8_t*>(weight_scale.data_ptr());
  a.n = weight.size(0);
  a.k = weight.size(1) * 2;
  a.weight = std::get<0>(out).data_ptr<uint8_t>();
  a.scale = std::get<1>(out).data_ptr<uint8_t>();
  return a;
}

nvfp4::gemm::UnpackArgs unpack_args(const at::Tensor& weight, const at::Tensor& weight_scale,
                                    const at::Tensor& weight_global, at::Tensor& out) {
  nvfp4::gemm::UnpackArgs a{};
  a.weight = weight.data_ptr<uint8_t>();
  a.scale = weight_scale.data_ptr<uint8_t>();
  a.global_scale = weight_global.data_ptr<float>();
  a.n = out.size(0);
  a.k = out.size(1);
  a.out = out.data_ptr();
  a.out_dtype = to_lowbit_dtype(out.scalar_type());
  return a;
}

namespace {

// The K recorded by the shapes of a prepacked weight [N, Kp/2] and scales
// [N, (2 Kp - K)/16] (nvfp4_linear_layout.h), or -1 where the shapes are not
// such a pair (or are symbolic). Both 2-D.
int64_t recorded_k(const at::Tensor& weight, const at::Tensor& weight_scale) {
  const auto n = weight.sym_size(0).maybe_as_int(), w_cols = weight.sym_size(1).maybe_as_int();
  const auto s_rows = weight_scale.sym_size(0).maybe_as_int(), s_cols = weight_scale.sym_size(1).maybe_as_int();
  if (!n || !w_cols || !s_rows || !s_cols || *n != *s_rows) return -1;
  const int64_t k = nvfp4::gemm::prepacked_k(*s_cols);
  if (k < 0 || nvfp4::gemm::prepacked_scale_cols(k) != *s_cols || nvfp4::gemm::padded_k(k) / 2 != *w_cols) return -1;
  return k;
}

// The prepacked weight [N, Kp/2] uint8, its scales [N, (2 Kp - K)/16] uint8
// and (unless null) the global [] float32 for K (Kp = K rounded up to 128),
// for op `op`. K is x's last dimension (x not null) or the argument 'k',
// which also takes scales [N, Kp/16] of the earlier format (no record of K).
void check_prepacked_weight(const char* op, const at::Tensor& weight, const at::Tensor& weight_scale,
                            const at::Tensor* weight_global, const c10::SymInt& k, const at::Tensor* x) {
  check_dtype(weight, op, "weight", {at::kByte});
  check_dims(weight, op, "weight", {2});
  check_dtype(weight_scale, op, "weight_scale", {at::kByte});
  check_dims(weight_scale, op, "weight_scale", {2});
  if (weight_global != nullptr) check_dtype(*weight_global, op, "weight_global", {at::kFloat});
  TORCH_CHECK_VALUE(weight.sym_size(0) % nvfp4::gemm::kTileN == 0, "lowbit.", op,
                    ": argument 'weight' must have a first dimension (N) divisible by 16, got shape ",
                    weight.sym_sizes());
  const c10::SymInt kp = padded_k_sym(k);
  const c10::SymInt cols = prepacked_scale_cols_sym(k);
  const bool fits = weight.sym_size(1) == kp / 2 && weight_scale.sym_size(0) == weight.sym_size(0) &&
                    (weight_scale.sym_size(1) == cols ||
                     (x == nullptr && weight_scale.sym_size(1) == kp / nvfp4::kBlockSize));
  if (!fits) {
    const int64_t recorded = recorded_k(weight, weight_scale);
    if (recorded >= 0 && x != nullptr) {
      // An earlier format's scales [N, Kp/16] read as K = Kp.
      const auto xk = k.maybe_as_int();
      const bool earlier = xk && *xk % nvfp4::gemm::kTileK != 0 && nvfp4::gemm::padded_k(*xk) == recorded;
      TORCH_CHECK_VALUE(false, "lowbit.", op, ": argument 'x' must have K = ", recorded,
                        " columns (the K 'weight' and 'weight_scale' were prepacked for), got shape ", x->sym_sizes(),
                        earlier ? "; if the weight was prepacked by an earlier lowbit, whose weight_scale [N, Kp/16] "
                                  "does not record K, prepack it again (lowbit.nvfp4_prepack) or load the state dict "
                                  "into an Nvfp4Linear, which converts it"
                                : "");
    }
    if (recorded >= 0) {
      TORCH_CHECK_VALUE(false, "lowbit.", op, ": argument 'k' must be the K the weight was prepacked for (", recorded,
                        "), got ", k);
    }
    TORCH_CHECK_VALUE(weight.sym_size(1) == kp / 2, "lowbit.", op,
                      ": argument 'weight' must be prepacked (lowbit.nvfp4_prepack) for K = ", k,
                      ", i.e. have shape [N, ", kp / 2, "], got ", weight.sym_sizes());
    check_shape(weight_scale, c10::SymDimVector{weight.sym_size(0), cols}, op, "weight_scale");
  }
  if (weight_global != nullptr) check_shape(*weight_global, c10::SymDimVector{}, op, "weight_global");
}

}  // namespace

void check_unpack(const at::Tensor& weight, const at::Tensor& weight_scale, const at::Tensor& weight_global,
                  const c10::SymInt& k, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "lowbit.", kUnpack,
                   ": argument 'dtype' must be torch.float32, torch.bfloat16 or torch.float16, got ", dtype);
  TORCH_CHECK_VALUE(k >= 0 && k % nvfp4::kBlockSize == 0, "lowbit.", kUnpack,
                    ": argument 'k' must be a multiple of 16 (>= 0), got ", k);
  check_same_device(weight_scale, weight, kUnpack, "weight_scale", "weight");
  check_same_device(weight_global, weight, kUnpack, "weight_global", "weight");
  check_prepacked_weight(kUnpack, weight, weight_scale, &weight_global, k, nullptr);
}

void check_unprepack(const at::Tensor& weight, const at::Tensor& weight_scale, const c10::SymInt& k) {
  TORCH_CHECK_VALUE(k >= 0 && k % nvfp4::kBlockSize == 0, "lowbit.", kUnprepack,
                    ": argument 'k' must be a multiple of 16 (>= 0), got ", k);
  check_same_device(weight_scale, weight, kUnprepack, "weight_scale", "weight");
  check_prepacked_weight(kUnprepack, weight, weight_scale, nullptr, k, nullptr);
}

namespace {

std::tuple<at::Tensor, at::Tensor> empty_unprepack_outputs(const at::Tensor& weight, const c10::SymInt& k) {
  auto opts = weight.options().dtype(at::kByte);
  return {at::empty_symint(c10::SymDimVector{weight.sym_size(0), k / 2}, opts),
          at::empty_symint(c10::SymDimVector{weight.sym_size(0), k / nvfp4::kBlockSize},
                           opts.dtype(at::kFloat8_e4m3fn))};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> unprepacked_cpu(const at::Tensor& weight, const at::Tensor& weight_scale,
                                                   int64_t k) {
  auto w = weight.contiguous();
  auto s = weight_scale.contiguous();
  auto out = empty_unprepack_outputs(w, k);
  nvfp4::gemm::UnprepackArgs a{};
  a.weight = w.data_ptr<uint8_t>();
  a.scale = s.data_ptr<uint8_t>();
  a.n = w.size(0);
  a.k = k;
  a.codes = std::get<0>(out).data_ptr<uint8_t>();
  a.block_scale = reinterpret_cast<uint8_t*>(std::get<1>(out).data_ptr());
  if (a.n > 0 && k > 0) nvfp4::gemm::unprepack_cpu(a);
  return out;
}

void check_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                  const at::Tensor& weight_global, const c10::optional<at::Tensor>& bias, int64_t fp8_min_rows,
                  const c10::optional<at::Tensor>& weight_fp8, const c10::optional<at::Tensor>& weight_fp8_scale) {
  check_dtype(x, kLinear, "x", {at::kBFloat16, at::kHalf, at::kFloat});
  TORCH_CHECK_VALUE(x.dim() >= 1, "lowbit.", kLinear, ": argument 'x' must be at least 1-D, got shape ",
                    x.sym_sizes());
  check_last_dim_multiple(x, nvfp4::kBlockSize, kLinear, "x");
  check_same_device(weight, x, kLinear, "weight", "x");
  check_same_device(weight_scale, x, kLinear, "weight_scale", "x");
  check_same_device(weight_global, x, kLinear, "weight_global", "x");
  check_prepacked_weight(kLinear, weight, weight_scale, &weight_global, x.sym_sizes().back(), &x);
  if (bias.has_value()) {
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "lowbit.", kLinear,
                     ": argument 'bias' must have the dtype of 'x' (", x.scalar_type(), "), got ",
                     bias->scalar_type());
    check_same_device(*bias, x, kLinear, "bias", "x");
    check_shape(*bias, c10::SymDimVector{weight.sym_size(0)}, kLinear, "bias");
  }
  TORCH_CHECK_VALUE(fp8_min_rows >= 0, "lowbit.", kLinear,
                    ": argument 'fp8_min_rows' must be >= 0 (0: never the FP8 mode), got ", fp8_min_rows);
  TORCH_CHECK_VALUE(weight_fp8.has_value() == weight_fp8_scale.has_value(), "lowbit.", kLinear,
                    ": arguments 'weight_fp8' and 'weight_fp8_scale' must be given together (lowbit.nvfp4_to_fp8 "
                    "makes both), got only '", weight_fp8.has_value() ? "weight_fp8" : "weight_fp8_scale", "'");
  if (!weight_fp8.has_value()) return;
  TORCH_CHECK_VALUE(fp8_min_rows > 0, "lowbit.", kLinear,
                    ": argument 'weight_fp8' is used only by the FP8 path, so 'fp8_min_rows' must be > 0 with it "
                    "(1: every call), got 0");
  check_dtype(*weight_fp8, kLinear, "weight_fp8", {at::kFloat8_e4m3fn, at::kByte});
  check_same_device(*weight_fp8, x, kLinear, "weight_fp8", "x");
  check_shape(*weight_fp8, c10::SymDimVector{weight.sym_size(0), x.sym_sizes().back()}, kLinear, "weight_fp8");
  check_dtype(*weight_fp8_scale, kLinear, "weight_fp8_scale", {at::kFloat});
  check_same_device(*weight_fp8_scale, x, kLinear, "weight_fp8_scale", "x");
  check_shape(*weight_fp8_scale, c10::SymDimVector{weight.sym_size(0)}, kLinear, "weight_fp8_scale");
}

void check_to_fp8(const at::Tensor& weight, const at::Tensor& weight_scale, const at::Tensor& weight_global,
                  const c10::SymInt& k) {
  TORCH_CHECK_VALUE(k >= 0 && k % nvfp4::kBlockSize == 0, "lowbit.", kToFp8,
                    ": argument 'k' must be a multiple of 16 (>= 0), got ", k);
  check_same_device(weight_scale, weight, kToFp8, "weight_scale", "weight");
  check_same_device(weight_global, weight, kToFp8, "weight_global", "weight");
  check_prepacked_weight(kToFp8, weight, weight_scale, &weight_global, k, nullptr);
}

std::tuple<at::Tensor, at::Tensor> empty_to_fp8_outputs(const at::Tensor& weight, const c10::SymInt& k) {
  return {at::empty_symint(c10::SymDimVector{weight.sym_size(0), k}, weight.options().dtype(at::kFloat8_e4m3fn)),
          at::empty_symint(c10::SymDimVector{weight.sym_size(0)}, weight.options().dtype(at::kFloat))};
}

nvfp4::gemm::Fp8WeightArgs to_fp8_args(const at::Tensor& weight, const at::Tensor& weight_scale,
                                       const at::Tensor& weight_global, std::tuple<at::Tensor, at::Tensor>& out) {
  nvfp4::gemm::Fp8WeightArgs a{};
  a.weight = weight.data_ptr<uint8_t>();
  a.scale = weight_scale.data_ptr<uint8_t>();
  a.global_scale = weight_global.data_ptr<float>();
  a.n = std::get<0>(out).size(0);
  a.k = std::get<0>(out).size(1);
  a.out = reinterpret_cast<uint8_t*>(std::get<0>(out).data_ptr());
  a.row_scale = std::get<1>(out).data_ptr<float>();
  return a;
}

at::Tensor fp8_codes(const at::Tensor& weight_fp8) {
  return weight_fp8.scalar_type() == at::kByte ? weight_fp8.view(at::kFloat8_e4m3fn) : weight_fp8;
}

std::tuple<at::Tensor, at::Tensor> fp8_rows_cpu_impl(const at::Tensor& x2) {
  at::Tensor codes = at::empty(x2.sizes(), x2.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale = at::zeros({x2.size(0)}, x2.options().dtype(at::kFloat));
  nvfp4::gemm::Fp8RowsArgs a{};
  a.x = x2.data_ptr();
  a.dtype = to_lowbit_dtype(x2.scalar_type());
  a.m = x2.size(0);
  a.k = x2.size(1);
  a.out = reinterpret_cast<uint8_t*>(codes.data_ptr());
  a.row_scale = scale.data_ptr<float>();
  if (a.m > 0 && a.k > 0) nvfp4::gemm::fp8_rows_cpu(a);
  return {codes, scale};
}

void check_grouped_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                          const at::Tensor& weight_global, int64_t n_groups, int64_t max_fused_rows) {
  check_dtype(x, kGrouped, "x", {at::kBFloat16, at::kHalf, at::kFloat});
  TORCH_CHECK_VALUE(n_groups >= 1, "lowbit.", kGrouped, ": argument 'n_groups' must be >= 1, got ", n_groups);
  TORCH_CHECK_VALUE(max_fused_rows >= 0, "lowbit.", kGrouped, ": argument 'max_fused_rows' must be >= 0, got ",
                    max_fused_rows);
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.sym_size(-2) == n_groups, "lowbit.", kGrouped,
                    ": argument 'x' must have shape [..., n_groups (", n_groups, "), K], got ", x.sym_sizes());
  check_last_dim_multiple(x, nvfp4::kBlockSize, kGrouped, "x");
  check_same_device(weight, x, kGrouped, "weight", "x");
  check_same_device(weight_scale, x, kGrouped, "weight_scale", "x");
  check_same_device(weight_global, x, kGrouped, "weight_global", "x");
  check_prepacked_weight(kGrouped, weight, weight_scale, &weight_global, x.sym_sizes().back(), &x);
  TORCH_CHECK_VALUE(weight.sym_size(0) % (n_groups * nvfp4::gemm::kTileN) == 0, "lowbit.", kGrouped,
                    ": argument 'weight' must have n_groups (", n_groups, ") blocks of rows, each a multiple of 16, got ",
                    weight.sym_size(0), " rows");
}

c10::SymDimVector grouped_linear_output_shape(const at::Tensor& x, const at::Tensor& weight, int64_t n_groups) {
  c10::SymDimVector out(x.sym_sizes().begin(), x.sym_sizes().end());
  out.back() = weight.sym_size(0) / n_groups;
  return out;
}

c10::SymDimVector linear_output_shape(const at::Tensor& x, const at::Tensor& weight) {
  c10::SymDimVector out(x.sym_sizes().begin(), x.sym_sizes().end());
  out.back() = weight.sym_size(0);
  return out;
}

namespace {

std::tuple<at::Tensor, at::Tensor> prepack_cpu(const at::Tensor& weight, const at::Tensor& weight_scale) {
  check_prepack(weight, weight_scale);
  auto w = weight.contiguous();
  auto s = weight_scale.contiguous();
  auto out = empty_prepack_outputs(w);
  nvfp4::gemm::prepack_cpu(prepack_args(w, s, out));
  return out;
}

std::tuple<at::Tensor, at::Tensor> prepack_meta(const at::Tensor& weight, const at::Tensor& weight_scale) {
  check_prepack(weight, weight_scale);
  return empty_prepack_outputs(weight);
}

// The prepacked weight unpacked into a new [N, K] tensor of `dtype` on the
// CPU, times `global` (a float32 [] tensor).
at::Tensor unpacked_cpu(const at::Tensor& w, const at::Tensor& s, const at::Tensor& global, int64_t k,
                        at::ScalarType dtype) {
  at::Tensor out = at::empty({w.size(0), k}, w.options().dtype(dtype));
  if (out.numel() > 0) nvfp4::gemm::unpack_cpu(unpack_args(w, s, global, out));
  return out;
}

// The weight's FP8 form by the core's reference loops (nvfp4_linear.h, the
// rule): codes float8_e4m3fn [N, K] and row scales float32 [N].
std::tuple<at::Tensor, at::Tensor> to_fp8_cpu_impl(const at::Tensor& weight, const at::Tensor& weight_scale,
                                                   const at::Tensor& weight_global, int64_t k) {
  auto w = weight.contiguous();
  auto s = weight_scale.contiguous();
  auto g = weight_global.contiguous();
  auto out = empty_to_fp8_outputs(w, k);
  if (w.size(0) > 0 && k > 0) nvfp4::gemm::fp8_weight_cpu(to_fp8_args(w, s, g, out));
  else std::get<1>(out).zero_();  // K = 0: amax 0, scale 0
  return out;
}

std::tuple<at::Tensor, at::Tensor> to_fp8_cpu(const at::Tensor& weight, const at::Tensor& weight_scale,
                                              const at::Tensor& weight_global, int64_t k) {
  check_to_fp8(weight, weight_scale, weight_global, k);
  return to_fp8_cpu_impl(weight, weight_scale, weight_global, k);
}

std::tuple<at::Tensor, at::Tensor> to_fp8_meta(const at::Tensor& weight, const at::Tensor& weight_scale,
                                               const at::Tensor& weight_global, c10::SymInt k) {
  check_to_fp8(weight, weight_scale, weight_global, k);
  return empty_to_fp8_outputs(weight, k);
}

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                      const at::Tensor& weight_global, const c10::optional<at::Tensor>& bias, int64_t fp8_min_rows,
                      const c10::optional<at::Tensor>& weight_fp8, const c10::optional<at::Tensor>& weight_fp8_scale) {
  check_linear(x, weight, weight_scale, weight_global, bias, fp8_min_rows, weight_fp8, weight_fp8_scale);
  const int64_t k = x.size(-1);
  const int64_t m = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  auto w = weight.contiguous();
  auto s = weight_scale.contiguous();
  if (linear_uses_fp8(m, fp8_min_rows) && k > 0) {
    // The FP8 path: W's codes cached (weight_fp8) or made now, x's now.
    auto [w8, w_scale] = weight_fp8.has_value()
                             ? std::make_tuple(fp8_codes(*weight_fp8), *weight_fp8_scale)
                             : to_fp8_cpu_impl(w, s, weight_global, k);
    auto [x8, x_scale] = fp8_rows_cpu_impl(x.reshape({m, k}).contiguous());
    std::vector<int64_t> out_shape = x.sizes().vec();
    out_shape.back() = w.size(0);
    return fp8_linear_reference(x8, x_scale, w8, w_scale, bias, out_shape, x.scalar_type());
  }
  return linear_reference(x, weight_global.contiguous(), bias,
                          [&](const at::Tensor& global) { return unpacked_cpu(w, s, global, k, at::kFloat); });
}

}  // namespace

at::Tensor linear_reference(const at::Tensor& x, const at::Tensor& weight_global,
                            const c10::optional<at::Tensor>& bias,
                            const std::function<at::Tensor(const at::Tensor&)>& unpack_fp32) {
  at::Tensor y = at::matmul(x.to(at::kFloat), unpack_fp32(weight_global).t());
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y.to(x.scalar_type());
}

at::Tensor fp8_linear_reference(const at::Tensor& x8, const at::Tensor& x_scale, const at::Tensor& w8,
                                const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                                at::IntArrayRef out_shape, at::ScalarType dtype) {
  // Products of E4M3 values are exact in FP32; the sums round in FP32.
  at::Tensor y = at::matmul(x8.to(at::kFloat), w8.to(at::kFloat).t());
  y = (y * x_scale.unsqueeze(1) * w_scale.unsqueeze(0)).view(out_shape);
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y.to(dtype);
}

namespace {

at::Tensor unpack_weight_cpu(const at::Tensor& weight, const at::Tensor& weight_scale,
                             const at::Tensor& weight_global, int64_t k, at::ScalarType dtype) {
  check_unpack(weight, weight_scale, weight_global, k, dtype);
  return unpacked_cpu(weight.contiguous(), weight_scale.contiguous(), weight_global.contiguous(), k, dtype);
}

at::Tensor unpack_weight_meta(const at::Tensor& weight, const at::Tensor& weight_scale,
                              const at::Tensor& weight_global, c10::SymInt k, at::ScalarType dtype) {
  check_unpack(weight, weight_scale, weight_global, k, dtype);
  return at::empty_symint(c10::SymDimVector{weight.sym_size(0), k}, weight.options().dtype(dtype));
}

// The reference: the weight unpacked to FP32, per group x_g W_g^T in FP32,
// rounded once to x's dtype.
// max_fused_rows only picks CUDA kernels: the reference is the same math.
at::Tensor grouped_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                              const at::Tensor& weight_global, int64_t n_groups, int64_t max_fused_rows) {
  check_grouped_linear(x, weight, weight_scale, weight_global, n_groups, max_fused_rows);
  const int64_t k = x.size(-1), n = weight.size(0) / n_groups;
  const at::Tensor w = unpacked_cpu(weight.contiguous(), weight_scale.contiguous(), weight_global.contiguous(), k,
                                    at::kFloat).view({n_groups, n, k});
  const at::Tensor y = at::einsum("tgk,gnk->tgn", {x.reshape({-1, n_groups, k}).to(at::kFloat), w});
  auto shape = x.sizes().vec();
  shape.back() = n;
  return y.to(x.scalar_type()).contiguous().view(shape);
}

at::Tensor grouped_linear_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                               const at::Tensor& weight_global, int64_t n_groups, int64_t max_fused_rows) {
  check_grouped_linear(x, weight, weight_scale, weight_global, n_groups, max_fused_rows);
  return at::empty_symint(grouped_linear_output_shape(x, weight, n_groups), x.options());
}

std::tuple<at::Tensor, at::Tensor> unprepack_cpu(const at::Tensor& weight, const at::Tensor& weight_scale,
                                                 int64_t k) {
  check_unprepack(weight, weight_scale, k);
  return unprepacked_cpu(weight, weight_scale, k);
}

std::tuple<at::Tensor, at::Tensor> unprepack_meta(const at::Tensor& weight, const at::Tensor& weight_scale,
                                                  c10::SymInt k) {
  check_unprepack(weight, weight_scale, k);
  return empty_unprepack_outputs(weight, k);
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                       const at::Tensor& weight_global, const c10::optional<at::Tensor>& bias, int64_t fp8_min_rows,
                       const c10::optional<at::Tensor>& weight_fp8, const c10::optional<at::Tensor>& weight_fp8_scale) {
  check_linear(x, weight, weight_scale, weight_global, bias, fp8_min_rows, weight_fp8, weight_fp8_scale);
  return at::empty_symint(linear_output_shape(x, weight), x.options());
}

at::Tensor linear_with_plan_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                                const at::Tensor& weight_global, const c10::optional<at::Tensor>& bias,
                                int64_t fp8_min_rows, c10::string_view plan) {
  parse_linear_plan(plan, kLinearWithPlan);
  return linear_cpu(x, weight, weight_scale, weight_global, bias, fp8_min_rows, c10::nullopt, c10::nullopt);
}

at::Tensor linear_with_plan_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                                 const at::Tensor& weight_global, const c10::optional<at::Tensor>& bias,
                                 int64_t fp8_min_rows, c10::string_view plan) {
  parse_linear_plan(plan, kLinearWithPlan);
  return linear_meta(x, weight, weight_scale, weight_global, bias, fp8_min_rows, c10::nullopt, c10::nullopt);
}

}  // namespace

nvfp4::gemm::LinearPlanOverrides parse_linear_plan(c10::string_view plan, const char* op) {
  try {
    return nvfp4::gemm::parse_linear_plan_string(std::string(plan));
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(ValueError, c10::str("lowbit.", op, ": ", e.what()));
  }
}

std::string explain_linear_plan_op(int64_t m, int64_t n, int64_t k, int64_t device_index, c10::string_view plan) {
  [[maybe_unused]] const nvfp4::gemm::LinearPlanOverrides overrides = parse_linear_plan(plan, kExplain);
  TORCH_CHECK_VALUE(m >= 0 && n >= 0 && k >= 0, "lowbit.", kExplain, ": M, N and K must be >= 0, got ", m, ", ", n,
                    ", ", k);
  TORCH_CHECK_VALUE(n % nvfp4::gemm::kTileN == 0 && k % nvfp4::kBlockSize == 0, "lowbit.", kExplain,
                    ": N and K must be multiples of 16 (as a prepacked weight's), got ", n, " and ", k);
  TORCH_CHECK_VALUE(device_index >= -1, "lowbit.", kExplain,
                    ": the device index must be >= 0 (CUDA) or -1 (CPU), got ", device_index);
  if (device_index < 0)
    return "path: reference\nform: reference\n"
           "kernel: the CPU kernel, the reference: the weight unpacked to FP32, one FP32 matmul, the bias added "
           "in FP32, one rounding to x's dtype\n"
           "why: the CPU has one path for every shape\n"
           "workspace: 0 bytes\n"
           "device: CPU\n"
           "plan: " +
           std::string(plan.empty() ? "the shipped plan (no overrides)" : "checked, unused on the CPU") + "\n";
  if (m == 0 || n == 0 || k == 0)  // as linear_cuda: no kernel runs
    return "path: none\nform: none\n"
           "kernel: none: no products, the output is the bias (or zeros)\n"
           "why: M, N or K is 0\n"
           "workspace: 0 bytes\n";
#if defined(LOWBIT_WITH_CUDA)
  return explain_linear_plan_cuda(m, n, k, device_index, overrides);
#else
  TORCH_CHECK_NOT_IMPLEMENTED(false, "lowbit.", kExplain,
                              ": this build of lowbit has no CUDA kernels (built without nvcc); the CPU kernel "
                              "runs every shape");
  return {};
#endif
}

}  // namespace lowbit::ops

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("nvfp4_prepack", &lowbit::ops::prepack_cpu);
  m.impl("nvfp4_unpack", &lowbit::ops::unpack_weight_cpu);
  m.impl("nvfp4_unprepack", &lowbit::ops::unprepack_cpu);
  m.impl("nvfp4_to_fp8", &lowbit::ops::to_fp8_cpu);
  m.impl("nvfp4_grouped_linear", &lowbit::ops::grouped_linear_cpu);
  m.impl("nvfp4_linear", &lowbit::ops::linear_cpu);
  m.impl("_nvfp4_linear_with_plan", &lowbit::ops::linear_with_plan_cpu);
}

TORCH_LIBRARY_IMPL(lowbit, Meta, m) {
  m.impl("nvfp4_prepack", &lowbit::ops::prepack_meta);
  m.impl("nvfp4_unpack", &lowbit::ops::unpack_weight_meta);
  m.impl("nvfp4_unprepack", &lowbit::ops::unprepack_meta);
  m.impl("nvfp4_to_fp8", &lowbit::ops::to_fp8_meta);
  m.impl("nvfp4_grouped_linear", &lowbit::ops::grouped_linear_meta);
  m.impl("nvfp4_linear", &lowbit::ops::linear_meta);
  m.impl("_nvfp4_linear_with_plan", &lowbit::ops::linear_with_plan_meta);
}
