// split_row_gemm (fp8_split_gemm_cuda.h): when lowbit's split-K FP8 GEMM runs.
#include "fp8_split_gemm_cuda.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "lowbit/fp8/fp8_split_gemm.h"

namespace lowbit::ops {
namespace {

// With fewer splits cuBLASLt's row-scaled GEMM (fast accumulation) was as
// fast or faster on every shape measured on an H200 (2-4 splits: 0.65-1.02x
// its speed), with six to eight 1.01-2.2x (docs/perf/log/linear.md,
// "Linear v37").
constexpr int kSplitGemmMinSplits = 6;

}  // namespace

c10::optional<at::Tensor> split_row_gemm(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                                         const at::Tensor& scale_b, const c10::optional<at::Tensor>& bias,
                                         at::ScalarType out_dtype, bool fast_accum) {
  if (a.scalar_type() != at::kFloat8_e4m3fn || b.scalar_type() != at::kFloat8_e4m3fn) return c10::nullopt;
  if (out_dtype != at::kBFloat16 && out_dtype != at::kHalf) return c10::nullopt;
  if (bias.has_value() && bias->scalar_type() != out_dtype) return c10::nullopt;
  if (!a.is_contiguous() || !b.is_contiguous() || scale_a.scalar_type() != at::kFloat ||
      scale_b.scalar_type() != at::kFloat)
    return c10::nullopt;
  const at::Tensor sa = scale_a.contiguous(), sb = scale_b.contiguous();
  c10::optional<at::Tensor> bias_c;
  if (bias.has_value()) bias_c = bias->contiguous();
  fp8::SplitGemmArgs args{a.data_ptr(),
                          b.data_ptr(),
                          a.size(0),
                          b.size(0),
                          a.size(1),
                          sa.data_ptr<float>(),
                          sb.data_ptr<float>(),
                          bias_c.has_value() ? bias_c->data_ptr() : nullptr,
                          out_dtype == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16,
                          fast_accum,
                          nullptr};
  c10::cuda::CUDAGuard guard(a.device());
  const int splits = fp8::split_gemm_splits(args);
  if (splits < kSplitGemmMinSplits) return c10::nullopt;
  at::Tensor y = at::empty({args.m, args.n}, a.options().dtype(out_dtype));
  args.out = y.data_ptr();
  C10_CUDA_CHECK(fp8::split_gemm_cuda(args, splits, c10::cuda::getCurrentCUDAStream()));
  return y;
}

}  // namespace lowbit::ops
