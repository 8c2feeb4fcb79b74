// own_row_gemm (fp8_row_gemm_cuda.h): where lowbit's form of the row-scaled
// FP8 GEMM runs instead of cuBLASLt's.
#include "fp8_row_gemm_cuda.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "lowbit/fp8/fp8_scale_out.h"

namespace lowbit::ops {
namespace {

// The unit-scale GEMM and scaling pass up to this many outputs (half as
// many below kUnitScaleLongK): there the FP32 round trip (12 bytes an
// output and a launch) cost less than cuBLASLt's per-tensor GEMM saved over
// its row-scaled one on an H200; past them, or with K = 2048 past half, it
// was as fast or slower (docs/perf/log/linear.md, "Linear v38").
constexpr int64_t kUnitScaleMaxOutputs = int64_t(1) << 20;
constexpr int64_t kUnitScaleLongK = 3072;

bool unit_scale_takes(int64_t m, int64_t n, int64_t k) {
  const int64_t most = k >= kUnitScaleLongK ? kUnitScaleMaxOutputs : kUnitScaleMaxOutputs / 2;
  return n % 4 == 0 && m * n <= most;
}

c10::optional<at::Tensor> unit_scale_gemm(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                                          const at::Tensor& scale_b, const c10::optional<at::Tensor>& bias,
                                          at::ScalarType out_dtype, bool fast_accum) {
  const int64_t m = a.size(0), n = b.size(0);
  if (!unit_scale_takes(m, n, a.size(1))) return c10::nullopt;
  const float* one = nullptr;
  C10_CUDA_CHECK(fp8::unit_scale_cuda(&one));
  const at::Tensor unit = at::from_blob(const_cast<float*>(one), {}, a.options().dtype(at::kFloat));
  at::Tensor acc;
  try {
    acc = at::_scaled_mm(a, b.t(), unit, unit, c10::nullopt, c10::nullopt, at::kFloat, fast_accum);
  } catch (const c10::Error&) {
    // cuBLASLt's heuristic has no algorithm for this shape (it says so
    // before any launch): the row-scaled GEMM
    return c10::nullopt;
  }
  const at::Tensor sa = scale_a.contiguous(), sb = scale_b.contiguous();
  at::Tensor y = at::empty({m, n}, a.options().dtype(out_dtype));
  const fp8::ScaleOutArgs args{acc.data_ptr<float>(),
                               m,
                               n,
                               sa.data_ptr<float>(),
                               sb.data_ptr<float>(),
                               bias.has_value() ? bias->data_ptr() : nullptr,
                               out_dtype == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16,
                               y.data_ptr()};
  C10_CUDA_CHECK(fp8::scale_out_cuda(args, c10::cuda::getCurrentCUDAStream()));
  return y;
}

}  // namespace

c10::optional<at::Tensor> own_row_gemm(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                                       const at::Tensor& scale_b, const c10::optional<at::Tensor>& bias,
                                       at::ScalarType out_dtype, bool fast_accum) {
  if (a.scalar_type() != at::kFloat8_e4m3fn || b.scalar_type() != at::kFloat8_e4m3fn) return c10::nullopt;
  if (out_dtype != at::kBFloat16 && out_dtype != at::kHalf) return c10::nullopt;
  if (bias.has_value() && bias->scalar_type() != out_dtype) return c10::nullopt;
  if (!a.is_contiguous() || !b.is_contiguous() || scale_a.scalar_type() != at::kFloat ||
      scale_b.scalar_type() != at::kFloat)
    return c10::nullopt;
  c10::cuda::CUDAGuard guard(a.device());
  c10::optional<at::Tensor> bias_c;
  if (bias.has_value()) bias_c = bias->contiguous();
  return unit_scale_gemm(a, scale_a, b, scale_b, bias_c, out_dtype, fast_accum);
}

}  // namespace lowbit::ops
