// Shared pieces of the FP8 training bindings (CPU, CUDA and Meta kernels):
// argument parsing and checks, output shapes, the GEMM reference, and the
// Linear's forward / backward written once over a per-device backend.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "lowbit/fp8/fp8_cast.h"

namespace lowbit::ops::fp8ops {

using fp8::Format;
using fp8::Scaling;

using CastTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct CastOut {
  at::Tensor data, scale, data_t, scale_t, amax;
};

// The recipe of one Linear (docs/fp8.md): which scaling each operand gets.
struct Recipe {
  enum class Kind { kTensorwise, kDelayed, kRowwise, kBlockwise } kind;
  Format grad_format;
  bool amax_max;  // delayed: max over the history, else its most recent entry
  int64_t margin;
  bool pow2;
  Scaling activation() const;  // x and dy
  Scaling weight() const;      // W
};

Scaling parse_scaling(c10::string_view s, const char* op, const char* arg, bool allow_block2d);
Format parse_format(c10::string_view s, const char* op, const char* arg);
Recipe parse_recipe(c10::string_view recipe, c10::string_view grad_dtype, c10::string_view amax_compute,
                    int64_t margin, bool pow2, const char* op);
at::ScalarType fp8_dtype(Format f);

// Shape of the scales of a [rows, cols] tensor under `s` (fp8_cast.h).
c10::SymDimVector scale_shape(const c10::SymInt& rows, const c10::SymInt& cols, Scaling s);

// fp8_cast: checks, then empty outputs (SymInt-aware; the transposed pair
// [0]-shaped when not asked for).
void check_cast(const at::Tensor& input, Scaling scaling, const c10::optional<at::Tensor>& scale, const char* op);
CastOut empty_cast_outputs(const at::Tensor& input, Scaling scaling, Format format, bool transpose);
// The fp8_cast op's string arguments parsed and every argument checked: the
// first step of its CPU, CUDA and Meta kernels.
struct CastRequest {
  Scaling scaling;
  Format format;
};
CastRequest parse_cast(const at::Tensor& input, c10::string_view scaling, c10::string_view dtype,
                       const c10::optional<at::Tensor>& scale);
CastTuple as_tuple(const CastOut& o);
fp8::CastArgs cast_args(const at::Tensor& input, Scaling scaling, Format format, bool pow2,
                        const c10::optional<at::Tensor>& scale, CastOut& out);

// fp8_gemm: checks (argument names for the messages), the output dtype,
// and the reference: both operands dequantized to FP32 (code * scale, one
// rounding), an FP32 matmul, the bias added in FP32, one rounding to
// out_dtype. Runs on any device with ATen ops.
struct GemmNames {
  const char* op;
  const char* a;
  const char* scale_a;
  const char* b;
  const char* scale_b;
};
void check_gemm(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b, const at::Tensor& scale_b,
                Scaling sa, Scaling sb, const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                const GemmNames& names);
// The fp8_gemm op's arguments parsed and checked (every kernel's first step).
struct GemmRequest {
  Scaling sa, sb;
  at::ScalarType out_dtype;
};
GemmRequest parse_gemm(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b, const at::Tensor& scale_b,
                       c10::string_view scaling_a, c10::string_view scaling_b, const c10::optional<at::Tensor>& bias,
                       c10::optional<at::ScalarType> out_dtype);
at::Tensor dequantize_fp32(const at::Tensor& data, const at::Tensor& scale, Scaling s);
at::Tensor gemm_reference(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                          const at::Tensor& scale_b, Scaling sa, Scaling sb, const c10::optional<at::Tensor>& bias,
                          at::ScalarType out_dtype);

// What the Linear needs from a device.
struct Backend {
  CastOut (*cast)(const at::Tensor& input, Scaling, Format, bool transpose, const c10::optional<at::Tensor>& scale,
                  bool pow2);
  // The same cast into preallocated contiguous outputs of the right shapes
  // and dtypes (the weight cache buffers; data_t 2-D: the transposed copy).
  void (*cast_into)(const at::Tensor& input, Scaling, Format, const c10::optional<at::Tensor>& scale, bool pow2,
                    CastOut& out);
  // fast_accum: the op's flag (the CPU reference ignores it).
  at::Tensor (*gemm)(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b, const at::Tensor& scale_b,
                     Scaling, Scaling, const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                     bool fast_accum);
  // The delayed scales of history rows [row0, row0 + n) under `f`'s fmax
  // and the recipe's amax_compute, margin and pow2: [n] float32, from the
  // history as it is before this step records anything.
  at::Tensor (*delayed_scales)(const at::Tensor& history, int64_t row0, int64_t n, const Recipe& r, Format f);
  // Records amax0 into history row row0 and amax1, if given, into row0 + 1
  // (float32, one value each, on the history's device), in place: the rows
  // roll one column towards the old end, column 0 takes the new amax, or
  // keeps its value where the amax is inf or NaN.
  void (*record_amax)(const at::Tensor& history, int64_t row0, const at::Tensor& amax0,
                      const c10::optional<at::Tensor>& amax1);
  // FP8 codes [R, C] -> their transposed copy [C, R] (contiguous).
  at::Tensor (*transpose_codes)(const at::Tensor& codes);
};

using LinearForwardOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The forward's optional inputs beyond the plain Linear: W already in FP8
// (the weight cache), x already in FP8 (an FP8 output of the layer before),
// whether y leaves in FP8, and whether the GEMM accumulates fast.
struct ForwardExtras {
  c10::optional<at::Tensor> w_fp8, w_fp8_scale, x_scale;
  c10::optional<at::Tensor> x_amax;  // with x_scale, delayed: x's amax to record
  c10::optional<at::Tensor> w_amax;  // with w_fp8, delayed: W's amax to record
  c10::optional<at::ScalarType> out_dtype;
  bool fp8_out = false;
  bool fast_accum = false;
};
using LinearBackwardOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

LinearForwardOut linear_forward(const Backend& be, const at::Tensor& x, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, const at::Tensor& amax_history,
                                c10::string_view recipe, c10::string_view grad_dtype, c10::string_view amax_compute,
                                int64_t margin, bool pow2_scales, bool save_x_t, bool save_w_t,
                                const ForwardExtras& extras);
// fp8_delayed_scale: history row `row`'s delayed scale, [] float32.
at::Tensor delayed_scale(const Backend& be, const at::Tensor& amax_history, int64_t row,
                         c10::string_view amax_compute, int64_t margin, bool pow2, c10::string_view dtype);
// fp8_record_amax: `amax` recorded in history row `row`, in place.
void record_amax_op(const Backend& be, const at::Tensor& amax_history, int64_t row, const at::Tensor& amax);
// fp8_linear_cache_weight: W cast into the cache buffers, in place.
void linear_cache_weight(const Backend& be, const at::Tensor& weight, const at::Tensor& amax_history,
                         const at::Tensor& w_data, const at::Tensor& w_scale, const at::Tensor& w_t_data,
                         const at::Tensor& w_t_scale, c10::string_view recipe, c10::string_view amax_compute,
                         int64_t margin, bool pow2_scales);
LinearBackwardOut linear_backward(const Backend& be, const at::Tensor& dy, const at::Tensor& x_t,
                                  const at::Tensor& x_t_scale, const at::Tensor& w_t, const at::Tensor& w_t_scale,
                                  const at::Tensor& amax_history, c10::string_view recipe,
                                  c10::string_view grad_dtype, c10::string_view amax_compute, int64_t margin,
                                  bool pow2_scales, at::ScalarType weight_dtype,
                                  c10::optional<at::ScalarType> bias_dtype, bool compute_dx, bool compute_dw);

}  // namespace lowbit::ops::fp8ops
