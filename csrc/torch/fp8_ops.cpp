// Bindings of the FP8 training ops (lowbit::fp8_cast, fp8_gemm,
// fp8_linear_forward, fp8_linear_backward): validation, output allocation,
// the GEMM reference, the Linear's forward / backward over a device backend,
// and the CPU and Meta kernels (CUDA in fp8_ops_cuda.cpp).
#include "fp8_ops.h"

#include <torch/library.h>

#include <limits>

#include "checks.h"

namespace lowbit::ops::fp8ops {
namespace {

constexpr const char* kCast = "fp8_cast";
constexpr const char* kGemm = "fp8_gemm";
constexpr const char* kForward = "fp8_linear_forward";
constexpr const char* kBackward = "fp8_linear_backward";
constexpr const char* kCacheWeight = "fp8_linear_cache_weight";
constexpr int64_t kHistoryRows = 3;  // x, W, dy
constexpr int64_t kMaxMargin = 64;

c10::SymInt ceil128(const c10::SymInt& v) { return (v + (fp8::kBlockSize - 1)) / fp8::kBlockSize; }

const char* scaling_name(Scaling s) {
  switch (s) {
    case Scaling::kTensor: return "tensor";
    case Scaling::kRow: return "row";
    case Scaling::kBlock: return "block";
    case Scaling::kBlock2d: return "block2d";
  }
  return "?";
}

void check_float_input(const at::Tensor& t, const char* op, const char* arg) {
  check_dtype(t, op, arg, {at::kBFloat16, at::kHalf, at::kFloat});
}

}  // namespace

Scaling Recipe::activation() const {
  switch (kind) {
    case Kind::kRowwise: return Scaling::kRow;
    case Kind::kBlockwise: return Scaling::kBlock;
    default: return Scaling::kTensor;
  }
}

Scaling Recipe::weight() const {
  switch (kind) {
    case Kind::kRowwise: return Scaling::kRow;
    case Kind::kBlockwise: return Scaling::kBlock2d;
    default: return Scaling::kTensor;
  }
}

Scaling parse_scaling(c10::string_view s, const char* op, const char* arg, bool allow_block2d) {
  if (s == "tensor") return Scaling::kTensor;
  if (s == "row") return Scaling::kRow;
  if (s == "block") return Scaling::kBlock;
  if (s == "block2d" && allow_block2d) return Scaling::kBlock2d;
  TORCH_CHECK_VALUE(false, "lowbit.", op, ": argument '", arg, "' must be \"tensor\", \"row\", \"block\"",
                    allow_block2d ? " or \"block2d\"" : "", ", got \"", std::string(s), "\"");
}

Format parse_format(c10::string_view s, const char* op, const char* arg) {
  if (s == "e4m3") return Format::kE4M3;
  if (s == "e5m2") return Format::kE5M2;
  TORCH_CHECK_VALUE(false, "lowbit.", op, ": argument '", arg, "' must be \"e4m3\" or \"e5m2\", got \"",
                    std::string(s), "\"");
}

Recipe parse_recipe(c10::string_view recipe, c10::string_view grad_dtype, c10::string_view amax_compute,
                    int64_t margin, bool pow2, const char* op) {
  Recipe r{};
  if (recipe == "tensorwise") {
    r.kind = Recipe::Kind::kTensorwise;
  } else if (recipe == "delayed") {
    r.kind = Recipe::Kind::kDelayed;
  } else if (recipe == "rowwise") {
    r.kind = Recipe::Kind::kRowwise;
  } else if (recipe == "blockwise") {
    r.kind = Recipe::Kind::kBlockwise;
  } else {
    TORCH_CHECK_VALUE(false, "lowbit.", op,
                      ": argument 'recipe' must be \"tensorwise\", \"delayed\", \"rowwise\" or \"blockwise\", got \"",
                      std::string(recipe), "\"");
  }
  r.grad_format = parse_format(grad_dtype, op, "grad_dtype");
  TORCH_CHECK_VALUE(amax_compute == "max" || amax_compute == "most_recent", "lowbit.", op,
                    ": argument 'amax_compute' must be \"max\" or \"most_recent\", got \"", std::string(amax_compute),
                    "\"");
  r.amax_max = amax_compute == "max";
  TORCH_CHECK_VALUE(margin >= -kMaxMargin && margin <= kMaxMargin, "lowbit.", op, ": argument 'margin' must be in [",
                    -kMaxMargin, ", ", kMaxMargin, "], got ", margin);
  r.margin = margin;
  r.pow2 = pow2;
  return r;
}

at::ScalarType fp8_dtype(Format f) { return f == Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2; }

c10::SymDimVector scale_shape(const c10::SymInt& rows, const c10::SymInt& cols, Scaling s) {
  switch (s) {
    case Scaling::kTensor: return {};
    case Scaling::kRow: return {rows};
    case Scaling::kBlock: return {rows, ceil128(cols)};
    case Scaling::kBlock2d: return {ceil128(rows), ceil128(cols)};
  }
  return {};
}

// ---- fp8_cast ---------------------------------------------------------------

void check_cast(const at::Tensor& input, Scaling scaling, const c10::optional<at::Tensor>& scale, const char* op) {
  check_float_input(input, op, "input");
  check_dims(input, op, "input", {2});
  if (scale.has_value()) {
    TORCH_CHECK_VALUE(scaling == Scaling::kTensor, "lowbit.", op,
                      ": argument 'scale' may be given only with scaling \"tensor\", got scaling \"",
                      scaling_name(scaling), "\"");
    check_dtype(*scale, op, "scale", {at::kFloat});
    check_same_device(*scale, input, op, "scale", "input");
    check_shape(*scale, c10::SymDimVector{}, op, "scale");
  }
}

CastRequest parse_cast(const at::Tensor& input, c10::string_view scaling, c10::string_view dtype,
                       const c10::optional<at::Tensor>& scale) {
  const CastRequest r{parse_scaling(scaling, kCast, "scaling", true), parse_format(dtype, kCast, "dtype")};
  check_cast(input, r.scaling, scale, kCast);
  return r;
}

CastTuple as_tuple(const CastOut& o) { return {o.data, o.scale, o.data_t, o.scale_t, o.amax}; }

CastOut empty_cast_outputs(const at::Tensor& input, Scaling scaling, Format format, bool transpose) {
  const c10::SymInt& m = input.sym_size(0);
  const c10::SymInt& k = input.sym_size(1);
  const auto f32 = input.options().dtype(at::kFloat);
  const auto q = input.options().dtype(fp8_dtype(format));
  CastOut o;
  o.data = at::empty_symint(c10::SymDimVector{m, k}, q);
  o.scale = at::empty_symint(scale_shape(m, k, scaling), f32);
  o.data_t = transpose ? at::empty_symint(c10::SymDimVector{k, m}, q) : at::empty({0}, q);
  o.scale_t = transpose ? at::empty_symint(scale_shape(k, m, scaling), f32) : at::empty({0}, f32);
  o.amax = at::empty({}, f32);
  return o;
}

fp8::CastArgs cast_args(const at::Tensor& input, Scaling scaling, Format format, bool pow2,
                        const c10::optional<at::Tensor>& scale, CastOut& out) {
  fp8::CastArgs a{};
  a.input = input.data_ptr();
  a.input_dtype = to_lowbit_dtype(input.scalar_type());
  a.rows = input.size(0);
  a.cols = input.size(1);
  a.scaling = scaling;
  a.format = format;
  a.pow2 = pow2;
  a.given_scale = scale.has_value() ? scale->data_ptr<float>() : nullptr;
  a.data = reinterpret_cast<uint8_t*>(out.data.data_ptr());
  a.scale = out.scale.data_ptr<float>();
  a.transpose = out.data_t.dim() == 2;
  a.data_t = a.transpose ? reinterpret_cast<uint8_t*>(out.data_t.data_ptr()) : nullptr;
  a.scale_t = a.transpose ? out.scale_t.data_ptr<float>() : nullptr;
  a.amax = out.amax.data_ptr<float>();
  return a;
}

// ---- fp8_gemm ---------------------------------------------------------------

void check_gemm(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b, const at::Tensor& scale_b,
                Scaling sa, Scaling sb, const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                const GemmNames& n) {
  const char* op = n.op;
  check_dtype(a, op, n.a, {at::kFloat8_e4m3fn, at::kFloat8_e5m2});
  check_dtype(b, op, n.b, {at::kFloat8_e4m3fn, at::kFloat8_e5m2});
  check_dims(a, op, n.a, {2});
  check_dims(b, op, n.b, {2});
  check_same_device(b, a, op, n.b, n.a);
  TORCH_CHECK_VALUE(a.sym_size(1) == b.sym_size(1), "lowbit.", op, ": arguments '", n.a, "' [M, K] and '", n.b,
                    "' [N, K] must have the same K, got shapes ", a.sym_sizes(), " and ", b.sym_sizes());
  const bool pair_ok = (sa == Scaling::kTensor && sb == Scaling::kTensor) ||
                       (sa == Scaling::kRow && sb == Scaling::kRow) ||
                       (sa == Scaling::kBlock && (sb == Scaling::kBlock || sb == Scaling::kBlock2d));
  TORCH_CHECK_VALUE(pair_ok, "lowbit.", op, ": scalings (\"", scaling_name(sa), "\", \"", scaling_name(sb),
                    "\") of '", n.a, "' and '", n.b,
                    "' are not a supported pair: (tensor, tensor), (row, row), (block, block) or (block, block2d)");
  check_dtype(scale_a, op, n.scale_a, {at::kFloat});
  check_dtype(scale_b, op, n.scale_b, {at::kFloat});
  check_same_device(scale_a, a, op, n.scale_a, n.a);
  check_same_device(scale_b, a, op, n.scale_b, n.a);
  check_shape(scale_a, scale_shape(a.sym_size(0), a.sym_size(1), sa), op, n.scale_a);
  check_shape(scale_b, scale_shape(b.sym_size(0), b.sym_size(1), sb), op, n.scale_b);
  if (bias.has_value()) {
    check_float_input(*bias, op, "bias");
    check_same_device(*bias, a, op, "bias", n.a);
    check_shape(*bias, c10::SymDimVector{b.sym_size(0)}, op, "bias");
  }
  TORCH_CHECK_TYPE(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat, "lowbit.", op,
                   ": argument 'out_dtype' must be bfloat16, float16 or float32, got ", out_dtype);
}

GemmRequest parse_gemm(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b, const at::Tensor& scale_b,
                       c10::string_view scaling_a, c10::string_view scaling_b, const c10::optional<at::Tensor>& bias,
                       c10::optional<at::ScalarType> out_dtype) {
  const GemmRequest r{parse_scaling(scaling_a, kGemm, "scaling_a", false),
                      parse_scaling(scaling_b, kGemm, "scaling_b", true), out_dtype.value_or(at::kBFloat16)};
  check_gemm(a, scale_a, b, scale_b, r.sa, r.sb, bias, r.out_dtype, GemmNames{kGemm, "a", "scale_a", "b", "scale_b"});
  return r;
}

at::Tensor dequantize_fp32(const at::Tensor& data, const at::Tensor& scale, Scaling s) {
  const at::Tensor v = data.to(at::kFloat);
  const int64_t rows = data.size(0), cols = data.size(1), bs = fp8::kBlockSize;
  switch (s) {
    case Scaling::kTensor: return v * scale;
    case Scaling::kRow: return v * scale.unsqueeze(1);
    case Scaling::kBlock: {
      const int64_t nb = scale.size(1);
      return v * scale.unsqueeze(2).expand({rows, nb, bs}).reshape({rows, nb * bs}).narrow(1, 0, cols);
    }
    case Scaling::kBlock2d: {
      const int64_t rb = scale.size(0), cb = scale.size(1);
      const at::Tensor per_row = scale.unsqueeze(1).expand({rb, bs, cb}).reshape({rb * bs, cb}).narrow(0, 0, rows);
      return v * per_row.unsqueeze(2).expand({rows, cb, bs}).reshape({rows, cb * bs}).narrow(1, 0, cols);
    }
  }
  return v;
}

at::Tensor gemm_reference(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                          const at::Tensor& scale_b, Scaling sa, Scaling sb, const c10::optional<at::Tensor>& bias,
                          at::ScalarType out_dtype) {
  at::Tensor y = at::matmul(dequantize_fp32(a, scale_a, sa), dequantize_fp32(b, scale_b, sb).t());
  if (bias.has_value()) y = y + bias->to(at::kFloat);
  return y.to(out_dtype);
}

// ---- the Linear ---------------------------------------------------------------

namespace {

void check_history(const at::Tensor& h, const at::Tensor& x, const Recipe& r, const char* op) {
  if (r.kind != Recipe::Kind::kDelayed) return;  // stateless recipes ignore it
  check_dtype(h, op, "amax_history", {at::kFloat});
  check_same_device(h, x, op, "amax_history", "x");
  TORCH_CHECK_VALUE(h.dim() == 2 && h.sym_size(0) == kHistoryRows && h.sym_size(1) >= 1, "lowbit.", op,
                    ": argument 'amax_history' must have shape [3, L] (rows x, W, dy; L >= 1) for recipe "
                    "\"delayed\", got ",
                    h.sym_sizes());
}

void check_contiguous(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(t.is_contiguous(), "lowbit.", op, ": argument '", arg, "' must be contiguous (it is written in ",
                    "place), got strides ", t.strides());
}

// A cached FP8 operand: e4m3 data of `shape` and float32 scales of `scaling`.
void check_fp8_operand(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& ref, const char* ref_arg,
                       c10::SymIntArrayRef shape, Scaling scaling, const char* op, const char* data_arg,
                       const char* scale_arg) {
  check_dtype(data, op, data_arg, {at::kFloat8_e4m3fn});
  check_same_device(data, ref, op, data_arg, ref_arg);
  check_shape(data, shape, op, data_arg);
  check_dtype(scale, op, scale_arg, {at::kFloat});
  check_same_device(scale, ref, op, scale_arg, ref_arg);
  check_shape(scale, scale_shape(shape[0], shape[1], scaling), op, scale_arg);
}

at::ScalarType forward_out_dtype(const at::Tensor& x, const ForwardExtras& e) {
  if (e.out_dtype.has_value()) return *e.out_dtype;
  TORCH_CHECK_VALUE(!e.x_scale.has_value(), "lowbit.", kForward,
                    ": argument 'out_dtype' must be given when 'x' is FP8 (with 'x_scale')");
  return x.scalar_type();
}

// x_amax / w_amax: the amax of an operand given in FP8, for the delayed
// history: a float32 scalar on x's device, only with that operand in FP8.
void check_given_amax(const c10::optional<at::Tensor>& amax, bool operand_in_fp8, const at::Tensor& x,
                      const Recipe& r, const char* arg, const char* what, const char* needs) {
  if (!amax.has_value()) return;
  TORCH_CHECK_VALUE(operand_in_fp8 && r.kind == Recipe::Kind::kDelayed, "lowbit.", kForward, ": argument '", arg,
                    "' is the amax of ", what, " for the delayed history: it needs '", needs,
                    "' and recipe \"delayed\"");
  check_dtype(*amax, kForward, arg, {at::kFloat});
  check_same_device(*amax, x, kForward, arg, "x");
  check_shape(*amax, c10::SymDimVector{}, kForward, arg);
}

void check_linear_forward(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                          const at::Tensor& amax_history, const Recipe& r, bool save_x_t, bool save_w_t,
                          const ForwardExtras& e) {
  if (e.x_scale.has_value()) {
    // x already in FP8 (an fp8_out of the layer before, or x all-gathered
    // in FP8): its codes and scales under this recipe's activation scaling.
    // Its transposed copy for the weight gradient is its codes transposed
    // when one scale covers x; row or block scales of x^T run along the
    // tokens, which the codes of x cannot give.
    check_dims(x, kForward, "x", {2});
    check_fp8_operand(x, *e.x_scale, x, "x", x.sym_sizes(), r.activation(), kForward, "x", "x_scale");
    TORCH_CHECK_VALUE(!save_x_t || r.activation() == Scaling::kTensor, "lowbit.", kForward,
                      ": an FP8 'x' (with 'x_scale') scaled per row or block has no transposed copy for the weight "
                      "gradient: save_x_t must be False");
  } else {
    check_float_input(x, kForward, "x");
  }
  check_given_amax(e.x_amax, e.x_scale.has_value(), x, r, "x_amax", "an FP8 'x'", "x_scale");
  check_given_amax(e.w_amax, e.w_fp8.has_value(), x, r, "w_amax", "an FP8 W", "w_fp8");
  const at::ScalarType od = forward_out_dtype(x, e);
  TORCH_CHECK_TYPE(od == at::kBFloat16 || od == at::kHalf || od == at::kFloat, "lowbit.", kForward,
                   ": argument 'out_dtype' must be bfloat16, float16 or float32, got ", od);
  check_float_input(weight, kForward, "weight");
  check_dims(x, kForward, "x", {2});
  check_dims(weight, kForward, "weight", {2});
  check_same_device(weight, x, kForward, "weight", "x");
  TORCH_CHECK_VALUE(weight.sym_size(1) == x.sym_size(1), "lowbit.", kForward,
                    ": argument 'weight' [N, K] must have the K of 'x' [M, K] (", x.sym_size(1), "), got shape ",
                    weight.sym_sizes());
  if (bias.has_value()) {
    check_float_input(*bias, kForward, "bias");
    check_same_device(*bias, x, kForward, "bias", "x");
    check_shape(*bias, c10::SymDimVector{weight.sym_size(0)}, kForward, "bias");
  }
  TORCH_CHECK_VALUE(e.w_fp8.has_value() == e.w_fp8_scale.has_value(), "lowbit.", kForward,
                    ": arguments 'w_fp8' and 'w_fp8_scale' must be given together");
  if (e.w_fp8.has_value()) {
    // W already in FP8: the weight cache (fp8_linear_cache_weight, whose
    // caller holds W's transposed copy too) or W all-gathered in FP8. With
    // one scale for W its transposed copy is its codes transposed.
    check_fp8_operand(*e.w_fp8, *e.w_fp8_scale, x, "x", weight.sym_sizes(), r.weight(), kForward, "w_fp8",
                      "w_fp8_scale");
    TORCH_CHECK_VALUE(!save_w_t || r.weight() == Scaling::kTensor, "lowbit.", kForward,
                      ": an FP8 W ('w_fp8') scaled per row or block has no transposed copy for the input gradient: "
                      "save_w_t must be False");
  }
  check_history(amax_history, x, r, kForward);
}

void check_linear_backward(const at::Tensor& dy, const at::Tensor& x_t, const at::Tensor& x_t_scale,
                           const at::Tensor& w_t, const at::Tensor& w_t_scale, const at::Tensor& amax_history,
                           const Recipe& r, at::ScalarType weight_dtype, c10::optional<at::ScalarType> bias_dtype,
                           bool compute_dx, bool compute_dw) {
  check_float_input(dy, kBackward, "dy");
  check_dims(dy, kBackward, "dy", {2});
  auto float_type = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; };
  TORCH_CHECK_TYPE(float_type(weight_dtype), "lowbit.", kBackward,
                   ": argument 'weight_dtype' must be float32, bfloat16 or float16, got ", weight_dtype);
  TORCH_CHECK_TYPE(!bias_dtype.has_value() || float_type(*bias_dtype), "lowbit.", kBackward,
                   ": argument 'bias_dtype' must be float32, bfloat16 or float16, got ", *bias_dtype);
  // A saved transposed operand [K, dy_dim] (FP8 E4M3) and its scales, on dy's device.
  auto check_saved = [&](const at::Tensor& t, const at::Tensor& scale, const char* name, const char* scale_name,
                         const char* shape, int64_t dy_dim, const char* dim_name, Scaling scaling) {
    check_dims(t, kBackward, name, {2});
    TORCH_CHECK_VALUE(t.sym_size(1) == dy.sym_size(dy_dim), "lowbit.", kBackward, ": argument '", name, "' ",
                      shape, " must have the ", dim_name, " of 'dy' [M, N] (", dy.sym_size(dy_dim),
                      "), got shape ", t.sym_sizes());
    check_dtype(t, kBackward, name, {at::kFloat8_e4m3fn});
    check_dtype(scale, kBackward, scale_name, {at::kFloat});
    check_same_device(t, dy, kBackward, name, "dy");
    check_same_device(scale, dy, kBackward, scale_name, "dy");
    check_shape(scale, scale_shape(t.sym_size(0), t.sym_size(1), scaling), kBackward, scale_name);
  };
  if (compute_dx) check_saved(w_t, w_t_scale, "w_t", "w_t_scale", "[K, N]", 1, "N", r.weight());
  if (compute_dw) check_saved(x_t, x_t_scale, "x_t", "x_t_scale", "[K, M]", 0, "M", r.activation());
  check_history(amax_history, dy, r, kBackward);
}

LinearForwardOut empty_forward_outputs(const at::Tensor& x, const at::Tensor& weight, const Recipe& r,
                                       bool save_x_t, bool save_w_t, const ForwardExtras& e) {
  const c10::SymInt& m = x.sym_size(0);
  const c10::SymInt& k = x.sym_size(1);
  const c10::SymInt& n = weight.sym_size(0);
  const auto f32 = x.options().dtype(at::kFloat), q = x.options().dtype(at::kFloat8_e4m3fn);
  return {at::empty_symint(c10::SymDimVector{m, n}, e.fp8_out ? q : x.options().dtype(forward_out_dtype(x, e))),
          save_x_t ? at::empty_symint(c10::SymDimVector{k, m}, q) : at::empty({0}, q),
          save_x_t ? at::empty_symint(scale_shape(k, m, r.activation()), f32) : at::empty({0}, f32),
          save_w_t ? at::empty_symint(c10::SymDimVector{k, n}, q) : at::empty({0}, q),
          save_w_t ? at::empty_symint(scale_shape(k, n, r.weight()), f32) : at::empty({0}, f32),
          e.fp8_out ? at::empty_symint(scale_shape(m, n, r.activation()), f32) : at::empty({0}, f32)};
}

void check_cache_weight(const at::Tensor& weight, const at::Tensor& amax_history, const at::Tensor& w_data,
                        const at::Tensor& w_scale, const at::Tensor& w_t_data, const at::Tensor& w_t_scale,
                        const Recipe& r) {
  const char* op = kCacheWeight;
  check_float_input(weight, op, "weight");
  check_dims(weight, op, "weight", {2});
  const c10::SymInt& n = weight.sym_size(0);
  const c10::SymInt& k = weight.sym_size(1);
  check_fp8_operand(w_data, w_scale, weight, "weight", weight.sym_sizes(), r.weight(), op, "w_data", "w_scale");
  check_fp8_operand(w_t_data, w_t_scale, weight, "weight", c10::SymDimVector{k, n}, r.weight(), op, "w_t_data",
                    "w_t_scale");
  check_contiguous(w_data, op, "w_data");
  check_contiguous(w_scale, op, "w_scale");
  check_contiguous(w_t_data, op, "w_t_data");
  check_contiguous(w_t_scale, op, "w_t_scale");
  check_history(amax_history, weight, r, op);
}

LinearBackwardOut empty_backward_outputs(const at::Tensor& dy, const at::Tensor& x_t, const at::Tensor& w_t,
                                         at::ScalarType weight_dtype, c10::optional<at::ScalarType> bias_dtype,
                                         bool compute_dx, bool compute_dw) {
  const c10::SymInt& m = dy.sym_size(0);
  const c10::SymInt& n = dy.sym_size(1);
  return {compute_dx ? at::empty_symint(c10::SymDimVector{m, w_t.sym_size(0)}, dy.options())
                     : at::empty({0}, dy.options()),
          compute_dw ? at::empty_symint(c10::SymDimVector{n, x_t.sym_size(0)}, dy.options().dtype(weight_dtype))
                     : at::empty({0}, dy.options().dtype(weight_dtype)),
          bias_dtype.has_value() ? at::empty_symint(c10::SymDimVector{n}, dy.options().dtype(*bias_dtype))
                                 : at::empty({0}, dy.options())};
}

}  // namespace

LinearForwardOut linear_forward(const Backend& be, const at::Tensor& x, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, const at::Tensor& amax_history,
                                c10::string_view recipe, c10::string_view grad_dtype, c10::string_view amax_compute,
                                int64_t margin, bool pow2_scales, bool save_x_t, bool save_w_t,
                                const ForwardExtras& e) {
  const Recipe r = parse_recipe(recipe, grad_dtype, amax_compute, margin, pow2_scales, kForward);
  check_linear_forward(x, weight, bias, amax_history, r, save_x_t, save_w_t, e);
  const bool delayed = r.kind == Recipe::Kind::kDelayed;
  const bool x_fp8 = e.x_scale.has_value(), w_cached = e.w_fp8.has_value();
  c10::optional<at::Tensor> sx, sw;
  if (delayed) {
    const at::Tensor s = be.delayed_scales(amax_history, 0, 2, r, Format::kE4M3);
    sx = s.select(0, 0);
    sw = s.select(0, 1);
  }
  const auto f32 = x.options().dtype(at::kFloat), q = x.options().dtype(at::kFloat8_e4m3fn);
  // An operand given in FP8 is not cast: its data and scales are used as
  // they are; its transposed copy, where asked for (one scale: checked),
  // is its codes transposed under the same scale (a copy of it: an op's
  // output may not alias its inputs).
  auto given = [&](const at::Tensor& data, const at::Tensor& scale, bool transpose) {
    const at::Tensor d = data.contiguous(), s = scale.contiguous();
    return CastOut{d, s, transpose ? be.transpose_codes(d) : at::empty({0}, q),
                   transpose ? s.clone() : at::empty({0}, f32), at::Tensor()};
  };
  const CastOut cx = x_fp8 ? given(x, *e.x_scale, save_x_t)
                           : be.cast(x.contiguous(), r.activation(), Format::kE4M3, save_x_t, sx, r.pow2);
  const CastOut cw = w_cached ? given(*e.w_fp8, *e.w_fp8_scale, save_w_t)
                              : be.cast(weight.contiguous(), r.weight(), Format::kE4M3, save_w_t, sw, r.pow2);
  at::Tensor y = be.gemm(cx.data, cx.scale, cw.data, cw.scale, r.activation(), r.weight(), bias,
                         forward_out_dtype(x, e), e.fast_accum);
  at::Tensor y_scale = at::empty({0}, f32);
  if (e.fp8_out) {
    // y cast for the next layer as that layer would cast it (this recipe's
    // activation scaling, E4M3), from y rounded to out_dtype, so that the
    // FP8 hand-over gives the codes the unfused pair would. Current scaling
    // even for "delayed": the next layer's history is not visible here.
    CastOut cy = be.cast(y, r.activation(), Format::kE4M3, false, c10::nullopt, r.pow2);
    y = cy.data;
    y_scale = cy.scale;
  }
  if (delayed) {
    // The tensors cast here record their amaxes; an operand given in FP8
    // records the amax its caster passed (x_amax, w_amax), if any: a
    // cached W's was recorded by the cast that filled the cache (once per
    // refresh), an FP8-gathered W's comes with it.
    c10::optional<at::Tensor> x_amax = x_fp8 ? e.x_amax : c10::optional<at::Tensor>(cx.amax);
    c10::optional<at::Tensor> w_amax = w_cached ? e.w_amax : c10::optional<at::Tensor>(cw.amax);
    if (x_amax.has_value()) {
      be.record_amax(amax_history, 0, *x_amax, w_amax);  // rows x and W in one step
    } else if (w_amax.has_value()) {
      be.record_amax(amax_history, 1, *w_amax, c10::nullopt);
    }
  }
  return {y, cx.data_t, cx.scale_t, cw.data_t, cw.scale_t, y_scale};
}

at::Tensor delayed_scale(const Backend& be, const at::Tensor& amax_history, int64_t row,
                         c10::string_view amax_compute, int64_t margin, bool pow2, c10::string_view dtype) {
  constexpr const char* kOp = "fp8_delayed_scale";
  const Recipe r = parse_recipe("delayed", "e4m3", amax_compute, margin, pow2, kOp);
  const Format f = parse_format(dtype, kOp, "dtype");
  check_history(amax_history, amax_history, r, kOp);
  TORCH_CHECK_VALUE(row >= 0 && row < kHistoryRows, "lowbit.", kOp, ": argument 'row' must be 0 (x), 1 (W) or 2 (dy), got ",
                    row);
  if (amax_history.is_meta()) return at::empty({}, amax_history.options());
  return be.delayed_scales(amax_history, row, 1, r, f).reshape({});
}

void record_amax_op(const Backend& be, const at::Tensor& amax_history, int64_t row, const at::Tensor& amax) {
  constexpr const char* kOp = "fp8_record_amax";
  const Recipe r = parse_recipe("delayed", "e4m3", "max", 0, false, kOp);
  check_history(amax_history, amax_history, r, kOp);
  TORCH_CHECK_VALUE(row >= 0 && row < kHistoryRows, "lowbit.", kOp, ": argument 'row' must be 0 (x), 1 (W) or 2 (dy), got ",
                    row);
  check_dtype(amax, kOp, "amax", {at::kFloat});
  check_same_device(amax, amax_history, kOp, "amax", "amax_history");
  TORCH_CHECK_VALUE(amax.sym_numel() == 1, "lowbit.", kOp, ": argument 'amax' must hold one value, got shape ",
                    amax.sym_sizes());
  if (amax_history.is_meta()) return;
  be.record_amax(amax_history, row, amax, c10::nullopt);
}

void linear_cache_weight(const Backend& be, const at::Tensor& weight, const at::Tensor& amax_history,
                         const at::Tensor& w_data, const at::Tensor& w_scale, const at::Tensor& w_t_data,
                         const at::Tensor& w_t_scale, c10::string_view recipe, c10::string_view amax_compute,
                         int64_t margin, bool pow2_scales) {
  const Recipe r = parse_recipe(recipe, "e4m3", amax_compute, margin, pow2_scales, kCacheWeight);
  check_cache_weight(weight, amax_history, w_data, w_scale, w_t_data, w_t_scale, r);
  const bool delayed = r.kind == Recipe::Kind::kDelayed;
  c10::optional<at::Tensor> sw;
  if (delayed) sw = be.delayed_scales(amax_history, 1, 1, r, Format::kE4M3).select(0, 0);
  CastOut out{w_data, w_scale, w_t_data, w_t_scale, at::empty({}, weight.options().dtype(at::kFloat))};
  be.cast_into(weight.contiguous(), r.weight(), Format::kE4M3, sw, r.pow2, out);
  if (delayed) be.record_amax(amax_history, 1, out.amax, c10::nullopt);
}

LinearBackwardOut linear_backward(const Backend& be, const at::Tensor& dy, const at::Tensor& x_t,
                                  const at::Tensor& x_t_scale, const at::Tensor& w_t, const at::Tensor& w_t_scale,
                                  const at::Tensor& amax_history, c10::string_view recipe,
                                  c10::string_view grad_dtype, c10::string_view amax_compute, int64_t margin,
                                  bool pow2_scales, at::ScalarType weight_dtype,
                                  c10::optional<at::ScalarType> bias_dtype, bool compute_dx, bool compute_dw) {
  const Recipe r = parse_recipe(recipe, grad_dtype, amax_compute, margin, pow2_scales, kBackward);
  check_linear_backward(dy, x_t, x_t_scale, w_t, w_t_scale, amax_history, r, weight_dtype, bias_dtype, compute_dx,
                        compute_dw);
  const bool delayed = r.kind == Recipe::Kind::kDelayed;
  c10::optional<at::Tensor> sdy;
  if (delayed) sdy = be.delayed_scales(amax_history, 2, 1, r, r.grad_format).select(0, 0);
  auto out = empty_backward_outputs(dy, x_t, w_t, weight_dtype, bias_dtype, false, false);
  const CastOut cdy = be.cast(dy.contiguous(), r.activation(), r.grad_format, compute_dw, sdy, r.pow2);
  if (compute_dx)
    std::get<0>(out) = be.gemm(cdy.data, cdy.scale, w_t.contiguous(), w_t_scale.contiguous(), r.activation(),
                               r.weight(), c10::nullopt, dy.scalar_type(), /*fast_accum=*/false);
  if (compute_dw)
    std::get<1>(out) = be.gemm(cdy.data_t, cdy.scale_t, x_t.contiguous(), x_t_scale.contiguous(), r.activation(),
                               r.activation(), c10::nullopt, weight_dtype, /*fast_accum=*/false);
  if (bias_dtype.has_value()) std::get<2>(out) = dy.sum(0, false, at::kFloat).to(*bias_dtype);
  if (delayed) be.record_amax(amax_history, 2, cdy.amax, c10::nullopt);
  return out;
}

// ---- CPU and Meta kernels -------------------------------------------------------

namespace {

void cast_into_cpu(const at::Tensor& input, Scaling scaling, Format format, const c10::optional<at::Tensor>& scale,
                   bool pow2, CastOut& out) {
  const at::Tensor x = input.contiguous();
  c10::optional<at::Tensor> s;
  if (scale.has_value()) s = scale->contiguous();
  fp8::cast_cpu(cast_args(x, scaling, format, pow2, s, out));
}

CastOut cast_cpu_impl(const at::Tensor& input, Scaling scaling, Format format, bool transpose,
                      const c10::optional<at::Tensor>& scale, bool pow2) {
  CastOut out = empty_cast_outputs(input, scaling, format, transpose);
  cast_into_cpu(input, scaling, format, scale, pow2, out);
  return out;
}

// The history's reference: ATen ops over it (the CUDA backend's kernels,
// csrc/lowbit/fp8/fp8_history.cu, give the same bits in one launch each).
at::Tensor delayed_scales_cpu(const at::Tensor& h, int64_t row0, int64_t n, const Recipe& r, Format f) {
  const at::Tensor rows = h.narrow(0, row0, n);
  const at::Tensor reduced = r.amax_max ? rows.amax(1) : rows.select(1, 0).contiguous();
  at::Tensor out = at::empty_like(reduced);
  fp8::scale_from_amax_cpu({reduced.data_ptr<float>(), n, fp8::format_max(f), static_cast<int>(r.margin), r.pow2,
                            out.data_ptr<float>()});
  return out;
}

// A non-finite amax (an inf or NaN in the tensor) is not recorded: the
// row's previous most recent value is, so one bad batch does not set the
// scales of the next L steps (TransformerEngine keeps the previous scale
// then). `amax < inf` is false for inf and NaN alike.
void record_amax_cpu(const at::Tensor& h, int64_t row0, const at::Tensor& amax0,
                     const c10::optional<at::Tensor>& amax1) {
  const at::Tensor amax =
      amax1.has_value() ? at::stack({amax0.reshape({}), amax1->reshape({})}) : amax0.reshape({1});
  at::Tensor rows = h.narrow(0, row0, amax.numel());
  const at::Tensor value = at::where(amax.lt(std::numeric_limits<float>::infinity()), amax, rows.select(1, 0));
  const int64_t len = h.size(1);
  if (len > 1) rows.narrow(1, 1, len - 1).copy_(rows.narrow(1, 0, len - 1).clone());
  rows.select(1, 0).copy_(value);
}

at::Tensor gemm_cpu_impl(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b, const at::Tensor& scale_b,
                         Scaling sa, Scaling sb, const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                         bool /*fast_accum: FP32 accumulation always*/) {
  return gemm_reference(a, scale_a, b, scale_b, sa, sb, bias, out_dtype);
}

// A copy always (.contiguous() of a transposed [1, K] is the input itself).
at::Tensor transpose_codes_cpu(const at::Tensor& codes) { return codes.t().clone(at::MemoryFormat::Contiguous); }

const Backend kCpuBackend{&cast_cpu_impl,      &cast_into_cpu,   &gemm_cpu_impl,
                          &delayed_scales_cpu, &record_amax_cpu, &transpose_codes_cpu};

CastTuple cast_cpu(const at::Tensor& input, c10::string_view scaling, c10::string_view dtype, bool transpose,
                   const c10::optional<at::Tensor>& scale, bool pow2_scales) {
  const CastRequest r = parse_cast(input, scaling, dtype, scale);
  return as_tuple(cast_cpu_impl(input, r.scaling, r.format, transpose, scale, pow2_scales));
}

CastTuple cast_meta(const at::Tensor& input, c10::string_view scaling, c10::string_view dtype, bool transpose,
                    const c10::optional<at::Tensor>& scale, bool pow2_scales) {
  const CastRequest r = parse_cast(input, scaling, dtype, scale);
  return as_tuple(empty_cast_outputs(input, r.scaling, r.format, transpose));
}

at::Tensor gemm_meta(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b, const at::Tensor& scale_b,
                     c10::string_view scaling_a, c10::string_view scaling_b, const c10::optional<at::Tensor>& bias,
                     c10::optional<at::ScalarType> out_dtype, bool /*fast_accum*/) {
  const GemmRequest r = parse_gemm(a, scale_a, b, scale_b, scaling_a, scaling_b, bias, out_dtype);
  return at::empty_symint(c10::SymDimVector{a.sym_size(0), b.sym_size(0)}, a.options().dtype(r.out_dtype));
}

at::Tensor gemm_cpu(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b, const at::Tensor& scale_b,
                    c10::string_view scaling_a, c10::string_view scaling_b, const c10::optional<at::Tensor>& bias,
                    c10::optional<at::ScalarType> out_dtype, bool /*fast_accum: FP32 accumulation always*/) {
  const GemmRequest r = parse_gemm(a, scale_a, b, scale_b, scaling_a, scaling_b, bias, out_dtype);
  return gemm_reference(a, scale_a, b, scale_b, r.sa, r.sb, bias, r.out_dtype);
}

LinearForwardOut forward_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                             at::Tensor& amax_history, c10::string_view recipe, c10::string_view grad_dtype,
                             c10::string_view amax_compute, int64_t margin, bool pow2_scales, bool save_x_t,
                             bool save_w_t, const c10::optional<at::Tensor>& w_fp8,
                             const c10::optional<at::Tensor>& w_fp8_scale, const c10::optional<at::Tensor>& x_scale,
                             c10::optional<at::ScalarType> out_dtype, bool fp8_out, bool fast_accum,
                             const c10::optional<at::Tensor>& x_amax, const c10::optional<at::Tensor>& w_amax) {
  return linear_forward(kCpuBackend, x, weight, bias, amax_history, recipe, grad_dtype, amax_compute, margin,
                        pow2_scales, save_x_t, save_w_t,
                        ForwardExtras{w_fp8, w_fp8_scale, x_scale, x_amax, w_amax, out_dtype, fp8_out, fast_accum});
}

LinearForwardOut forward_meta(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                              at::Tensor& amax_history, c10::string_view recipe, c10::string_view grad_dtype,
                              c10::string_view amax_compute, int64_t margin, bool pow2_scales, bool save_x_t,
                              bool save_w_t, const c10::optional<at::Tensor>& w_fp8,
                              const c10::optional<at::Tensor>& w_fp8_scale, const c10::optional<at::Tensor>& x_scale,
                              c10::optional<at::ScalarType> out_dtype, bool fp8_out, bool fast_accum,
                             const c10::optional<at::Tensor>& x_amax, const c10::optional<at::Tensor>& w_amax) {
  const Recipe r = parse_recipe(recipe, grad_dtype, amax_compute, margin, pow2_scales, kForward);
  const ForwardExtras e{w_fp8, w_fp8_scale, x_scale, x_amax, w_amax, out_dtype, fp8_out, fast_accum};
  check_linear_forward(x, weight, bias, amax_history, r, save_x_t, save_w_t, e);
  return empty_forward_outputs(x, weight, r, save_x_t, save_w_t, e);
}

void cache_weight_cpu(const at::Tensor& weight, at::Tensor& amax_history, at::Tensor& w_data, at::Tensor& w_scale,
                      at::Tensor& w_t_data, at::Tensor& w_t_scale, c10::string_view recipe,
                      c10::string_view amax_compute, int64_t margin, bool pow2_scales) {
  linear_cache_weight(kCpuBackend, weight, amax_history, w_data, w_scale, w_t_data, w_t_scale, recipe, amax_compute,
                      margin, pow2_scales);
}

void cache_weight_meta(const at::Tensor& weight, at::Tensor& amax_history, at::Tensor& w_data, at::Tensor& w_scale,
                       at::Tensor& w_t_data, at::Tensor& w_t_scale, c10::string_view recipe,
                       c10::string_view amax_compute, int64_t margin, bool pow2_scales) {
  const Recipe r = parse_recipe(recipe, "e4m3", amax_compute, margin, pow2_scales, kCacheWeight);
  check_cache_weight(weight, amax_history, w_data, w_scale, w_t_data, w_t_scale, r);
}

LinearBackwardOut backward_cpu(const at::Tensor& dy, const at::Tensor& x_t, const at::Tensor& x_t_scale,
                               const at::Tensor& w_t, const at::Tensor& w_t_scale, at::Tensor& amax_history,
                               c10::string_view recipe, c10::string_view grad_dtype, c10::string_view amax_compute,
                               int64_t margin, bool pow2_scales, at::ScalarType weight_dtype,
                               c10::optional<at::ScalarType> bias_dtype, bool compute_dx, bool compute_dw) {
  return linear_backward(kCpuBackend, dy, x_t, x_t_scale, w_t, w_t_scale, amax_history, recipe, grad_dtype,
                         amax_compute, margin, pow2_scales, weight_dtype, bias_dtype, compute_dx, compute_dw);
}

LinearBackwardOut backward_meta(const at::Tensor& dy, const at::Tensor& x_t, const at::Tensor& x_t_scale,
                                const at::Tensor& w_t, const at::Tensor& w_t_scale, at::Tensor& amax_history,
                                c10::string_view recipe, c10::string_view grad_dtype, c10::string_view amax_compute,
                                int64_t margin, bool pow2_scales, at::ScalarType weight_dtype,
                                c10::optional<at::ScalarType> bias_dtype, bool compute_dx, bool compute_dw) {
  const Recipe r = parse_recipe(recipe, grad_dtype, amax_compute, margin, pow2_scales, kBackward);
  check_linear_backward(dy, x_t, x_t_scale, w_t, w_t_scale, amax_history, r, weight_dtype, bias_dtype, compute_dx,
                        compute_dw);
  return empty_backward_outputs(dy, x_t, w_t, weight_dtype, bias_dtype, compute_dx, compute_dw);
}

// The Meta kernels return before the backend is used.
at::Tensor delayed_scale_cpu(const at::Tensor& amax_history, int64_t row, c10::string_view amax_compute,
                             int64_t margin, bool pow2_scales, c10::string_view dtype) {
  return delayed_scale(kCpuBackend, amax_history, row, amax_compute, margin, pow2_scales, dtype);
}

void record_amax_cpu_op(const at::Tensor& amax_history, int64_t row, const at::Tensor& amax) {
  record_amax_op(kCpuBackend, amax_history, row, amax);
}

}  // namespace
}  // namespace lowbit::ops::fp8ops

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("fp8_cast", &lowbit::ops::fp8ops::cast_cpu);
  m.impl("fp8_gemm", &lowbit::ops::fp8ops::gemm_cpu);
  m.impl("fp8_linear_forward", &lowbit::ops::fp8ops::forward_cpu);
  m.impl("fp8_linear_backward", &lowbit::ops::fp8ops::backward_cpu);
  m.impl("fp8_linear_cache_weight", &lowbit::ops::fp8ops::cache_weight_cpu);
  m.impl("fp8_delayed_scale", &lowbit::ops::fp8ops::delayed_scale_cpu);
  m.impl("fp8_record_amax", &lowbit::ops::fp8ops::record_amax_cpu_op);
}

TORCH_LIBRARY_IMPL(lowbit, Meta, m) {
  m.impl("fp8_cast", &lowbit::ops::fp8ops::cast_meta);
  m.impl("fp8_gemm", &lowbit::ops::fp8ops::gemm_meta);
  m.impl("fp8_linear_forward", &lowbit::ops::fp8ops::forward_meta);
  m.impl("fp8_linear_backward", &lowbit::ops::fp8ops::backward_meta);
  m.impl("fp8_linear_cache_weight", &lowbit::ops::fp8ops::cache_weight_meta);
  m.impl("fp8_delayed_scale", &lowbit::ops::fp8ops::delayed_scale_cpu);
  m.impl("fp8_record_amax", &lowbit::ops::fp8ops::record_amax_cpu_op);
}
