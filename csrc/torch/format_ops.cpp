// Bindings of lowbit::nvfp4_quantize / nvfp4_dequantize: validation, output
// allocation, and the CPU and Meta kernels (CUDA in format_ops_cuda.cpp).
#include "format_ops.h"

#include <torch/library.h>

#include <cmath>

#include "checks.h"

namespace lowbit::ops {
namespace {

constexpr const char* kQuantize = "nvfp4_quantize";
constexpr const char* kDequantize = "nvfp4_dequantize";

c10::SymDimVector with_last_dim(c10::SymIntArrayRef sizes, const c10::SymInt& last) {
  c10::SymDimVector out(sizes.begin(), sizes.end());
  out.back() = last;
  return out;
}

// Stacked groups map to grid.y of the CUDA kernels.
constexpr int64_t kMaxGroups = 65535;

void check_group_count(const at::Tensor& t, const char* op, const char* arg) {
  if (t.dim() == 3)
    TORCH_CHECK_VALUE(t.sym_size(0) <= kMaxGroups, "lowbit.", op, ": argument '", arg, "' may stack at most ",
                      kMaxGroups, " experts, got shape ", t.sym_sizes());
}

// Expected global-scale shape: [] for a 2-D tensor, [E] for stacked experts.
c10::SymDimVector global_shape(const at::Tensor& t) {
  if (t.dim() == 3) return c10::SymDimVector{t.sym_size(0)};
  return c10::SymDimVector{};
}

}  // namespace

void check_global_scale_values_cpu(const at::Tensor& global_scale) {
  const at::Tensor g = global_scale.contiguous();
  const float* v = g.data_ptr<float>();
  for (int64_t i = 0; i < g.numel(); ++i)
    TORCH_CHECK_VALUE(v[i] > 0.f && std::isfinite(v[i]), "lowbit.", kQuantize,
                      ": argument 'global_scale' must be positive and finite, got ", v[i], " at index ", i);
}

std::tuple<at::Tensor, c10::optional<at::Tensor>> prepare_quantize(const at::Tensor& input,
                                                                    const c10::optional<at::Tensor>& global_scale) {
  check_dtype(input, kQuantize, "input", {at::kBFloat16, at::kHalf, at::kFloat});
  check_dims(input, kQuantize, "input", {2, 3});
  check_last_dim_multiple(input, nvfp4::kBlockSize, kQuantize, "input");
  check_group_count(input, kQuantize, "input");
  c10::optional<at::Tensor> gs;
  if (global_scale.has_value()) {
    check_dtype(*global_scale, kQuantize, "global_scale", {at::kFloat});
    check_same_device(*global_scale, input, kQuantize, "global_scale", "input");
    check_shape(*global_scale, global_shape(input), kQuantize, "global_scale");
    gs = global_scale->contiguous();
  }
  return {contiguous_aligned(input, 32), gs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_quantize_outputs(const at::Tensor& input) {
  const auto sizes = input.sym_sizes();
  const c10::SymInt& k = sizes.back();
  auto opts = input.options();
  return {at::empty_symint(with_last_dim(sizes, k / 2), opts.dtype(at::kByte)),
          at::empty_symint(with_last_dim(sizes, k / nvfp4::kBlockSize), opts.dtype(at::kFloat8_e4m3fn)),
          at::empty_symint(global_shape(input), opts.dtype(at::kFloat))};
}

nvfp4::QuantizeArgs quantize_args(const at::Tensor& input, const c10::optional<at::Tensor>& global_scale,
                                  std::tuple<at::Tensor, at::Tensor, at::Tensor>& out) {
  nvfp4::QuantizeArgs a{};
  a.input = input.data_ptr();
  a.input_dtype = to_lowbit_dtype(input.scalar_type());
  a.groups = input.dim() == 3 ? input.size(0) : 1;
  a.rows = input.size(-2);
  a.cols = input.size(-1);
  a.global_scale_in = global_scale.has_value() ? global_scale->data_ptr<float>() : nullptr;
  a.packed = std::get<0>(out).data_ptr<uint8_t>();
  a.block_scale = reinterpret_cast<uint8_t*>(std::get<1>(out).data_ptr());
  a.global_scale_out = std::get<2>(out).data_ptr<float>();
  return a;
}

at::ScalarType dequantize_dtype(const c10::optional<at::ScalarType>& out_dtype) {
  return out_dtype.value_or(at::kFloat);
}

void check_dequantize(const at::Tensor& packed, const at::Tensor& block_scale, const at::Tensor& global_scale,
                      at::ScalarType out_dtype) {
  check_dtype(packed, kDequantize, "packed", {at::kByte});
  check_dims(packed, kDequantize, "packed", {2, 3});
  check_group_count(packed, kDequantize, "packed");
  check_dtype(block_scale, kDequantize, "block_scale", {at::kFloat8_e4m3fn, at::kByte});
  check_dtype(global_scale, kDequantize, "global_scale", {at::kFloat});
  check_same_device(block_scale, packed, kDequantize, "block_scale", "packed");
  check_same_device(global_scale, packed, kDequantize, "global_scale", "packed");
  TORCH_CHECK_TYPE(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf, "lowbit.",
                   kDequantize, ": argument 'out_dtype' must be float32, bfloat16 or float16, got ", out_dtype);
  check_last_dim_multiple(packed, nvfp4::kBlockSize / 2, kDequantize, "packed");
  check_shape(block_scale, with_last_dim(packed.sym_sizes(), packed.sym_sizes().back() / (nvfp4::kBlockSize / 2)),
              kDequantize, "block_scale");
  check_shape(global_scale, global_shape(packed), kDequantize, "global_scale");
}

nvfp4::DequantizeArgs dequantize_args(const at::Tensor& packed, const at::Tensor& block_scale,
                                      const at::Tensor& global_scale, at::Tensor& out) {
  nvfp4::DequantizeArgs a{};
  a.packed = packed.data_ptr<uint8_t>();
  a.block_scale = reinterpret_cast<const uint8_t*>(block_scale.data_ptr());
  a.global_scale = global_scale.data_ptr<float>();
  a.groups = packed.dim() == 3 ? packed.size(0) : 1;
  a.rows = packed.size(-2);
  a.cols = packed.size(-1) * 2;
  a.output = out.data_ptr();
  a.output_dtype = to_lowbit_dtype(out.scalar_type());
  return a;
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& input,
                                                            const c10::optional<at::Tensor>& global_scale) {
  auto [x, gs] = prepare_quantize(input, global_scale);
  if (gs.has_value()) check_global_scale_values_cpu(*gs);
  auto out = empty_quantize_outputs(x);
  nvfp4::quantize_cpu(quantize_args(x, gs, out));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_meta(const at::Tensor& input,
                                                             const c10::optional<at::Tensor>& global_scale) {
  check_dtype(input, kQuantize, "input", {at::kBFloat16, at::kHalf, at::kFloat});
  check_dims(input, kQuantize, "input", {2, 3});
  check_last_dim_multiple(input, nvfp4::kBlockSize, kQuantize, "input");
  if (global_scale.has_value()) {
    check_dtype(*global_scale, kQuantize, "global_scale", {at::kFloat});
    // A meta tensor beside a real one selects this kernel: refuse the mix as
    // the CPU and CUDA kernels do.
    check_same_device(*global_scale, input, kQuantize, "global_scale", "input");
    check_shape(*global_scale, global_shape(input), kQuantize, "global_scale");
  }
  return empty_quantize_outputs(input);
}

at::Tensor dequantize_cpu(const at::Tensor& packed, const at::Tensor& block_scale, const at::Tensor& global_scale,
                          c10::optional<at::ScalarType> out_dtype) {
  const auto dtype = dequantize_dtype(out_dtype);
  check_dequantize(packed, block_scale, global_scale, dtype);
  auto p = packed.contiguous();
  auto b = block_scale.contiguous();
  auto g = global_scale.contiguous();
  auto out = at::empty_symint(with_last_dim(p.sym_sizes(), p.sym_sizes().back() * 2), p.options().dtype(dtype));
  nvfp4::dequantize_cpu(dequantize_args(p, b, g, out));
  return out;
}

at::Tensor dequantize_meta(const at::Tensor& packed, const at::Tensor& block_scale, const at::Tensor& global_scale,
                           c10::optional<at::ScalarType> out_dtype) {
  const auto dtype = dequantize_dtype(out_dtype);
  check_dequantize(packed, block_scale, global_scale, dtype);
  return at::empty_symint(with_last_dim(packed.sym_sizes(), packed.sym_sizes().back() * 2),
                          packed.options().dtype(dtype));
}

}  // namespace
}  // namespace lowbit::ops

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("nvfp4_quantize", &lowbit::ops::quantize_cpu);
  m.impl("nvfp4_dequantize", &lowbit::ops::dequantize_cpu);
}

TORCH_LIBRARY_IMPL(lowbit, Meta, m) {
  m.impl("nvfp4_quantize", &lowbit::ops::quantize_meta);
  m.impl("nvfp4_dequantize", &lowbit::ops::dequantize_meta);
}
