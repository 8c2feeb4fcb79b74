// CUDA kernels of the FP8 training ops: the cast (csrc/lowbit/fp8/fp8_cast.cu),
// the GEMM (at::_scaled_mm (cuBLASLt) where it takes the shape, else
// lowbit's block-scaled kernel or the reference), the delayed history's
// scales and record (csrc/lowbit/fp8/fp8_history.cu), and the Linear's
// forward / backward (fp8_ops.cpp) over these.
//
// fp8_gemm on CUDA:
//   tensor x tensor, row x row: at::_scaled_mm, which needs K and N
//     multiples of 16 (cuBLASLt FP8: row-major a times column-major b, i.e.
//     our b [N, K] row-major, passed as b.t()); row x row E4M3 with a
//     bfloat16 / float16 output: on small outputs lowbit's form instead
//     (fp8_row_gemm_cuda.h: cuBLASLt's unit-scale GEMM and a scaling
//     pass).
//   block x block2d (1 x 128 by 128 x 128) and block x block (1 x 128 by
//     1 x 128): at::_scaled_mm's DeepSeek-style block scaling (cuBLASLt >=
//     12.9, compute capability 9.0 only), with its scale layouts: a's scales
//     [M, K/128] column-major; b's 128 x 128 scales passed as [K/128, N/128]
//     (our [N/128, K/128] transposed); b's 1 x 128 scales as [K/128, N]
//     row-major. Taken when K % 128 == 0, N % 16 == 0, M % 4 == 0 (the
//     column-major scales' stride M stays 16-byte aligned) and the output is
//     bfloat16; with 128 x 128 scales also only when K/128 % 4 == 0 or N <=
//     128. cuBLASLt reads 128 x 128 scales (BLK128x128_32F) with leading
//     dimension round_up(K/128, 4) (the cuBLAS docs' block-scaling layout,
//     what torch's _scaled_mm_v2 demands), while _scaled_mm accepts only the
//     unpadded stride K/128 and passes the pointer on: for K = 256, N = 512
//     cuBLASLt reads N-block 1's scales from block 2's and blocks 2 and 3's
//     from past the tensor's end (memory whose contents differ between eager
//     and a CUDA graph's pool). Those shapes take the next path.
//   block scales cuBLASLt does not take, with a bfloat16 or float32 output,
//     K a multiple of 128 and N of 16 (fp8::block_gemm_takes): lowbit's
//     block-scaled wgmma GEMM (csrc/lowbit/fp8/sm90_fp8_block_gemm.cu),
//     0.62-0.79x cuBLASLt's speed where both run, so second to it.
//   anything else (other shapes, float16 output with block scales, e5m2 x
//     e5m2): the reference formula on the device, both
//     operands dequantized to FP32 and an FP32 matmul. Correct but slow: a
//     fallback, marked as such in docs/fp8.md.
// The bias goes into cuBLASLt's epilogue when it has the output's dtype
// (bfloat16 / float16); otherwise it is added in FP32 afterwards.
// First run on an H100: docs/fp8.md, "What runs where".
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda_checks.h"
#include "fp8_ops.h"
#include "fp8_row_gemm_cuda.h"
#include "lowbit/fp8/fp8_block_gemm.h"
#include "lowbit/fp8/fp8_history.h"

namespace lowbit::ops::fp8ops {
namespace {

constexpr const char* kCast = "fp8_cast";
constexpr const char* kGemm = "fp8_gemm";

void cast_into_cuda(const at::Tensor& input, Scaling scaling, Format format, const c10::optional<at::Tensor>& scale,
                    bool pow2, CastOut& out) {
  c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  c10::optional<at::Tensor> s;
  if (scale.has_value()) s = scale->contiguous();
  fp8::CastArgs a = cast_args(x, scaling, format, pow2, s, out);
  at::Tensor workspace;
  const int64_t bytes = fp8::cast_workspace_bytes(a);
  if (bytes > 0) {
    workspace = at::empty({bytes}, x.options().dtype(at::kByte));
    a.workspace = workspace.data_ptr();
  }
  C10_CUDA_CHECK(fp8::cast_cuda(a, c10::cuda::getCurrentCUDAStream()));
}

CastOut cast_cuda_impl(const at::Tensor& input, Scaling scaling, Format format, bool transpose,
                       const c10::optional<at::Tensor>& scale, bool pow2) {
  CastOut out = empty_cast_outputs(input, scaling, format, transpose);
  cast_into_cuda(input, scaling, format, scale, pow2, out);
  return out;
}

// The delayed history, one launch each (csrc/lowbit/fp8/fp8_history.cu),
// bit for bit the CPU backend's ATen ops.
at::Tensor delayed_scales_cuda(const at::Tensor& h, int64_t row0, int64_t n, const Recipe& r, Format f) {
  c10::cuda::CUDAGuard guard(h.device());
  at::Tensor out = at::empty({n}, h.options());
  C10_CUDA_CHECK(fp8::history_scales_cuda({h.data_ptr<float>() + row0 * h.stride(0), n, h.size(1), h.stride(0),
                                           h.stride(1), r.amax_max, fp8::format_max(f), static_cast<int>(r.margin),
                                           r.pow2, out.data_ptr<float>()},
                                          c10::cuda::getCurrentCUDAStream()));
  return out;
}

void record_amax_cuda_impl(const at::Tensor& h, int64_t row0, const at::Tensor& amax0,
                           const c10::optional<at::Tensor>& amax1) {
  c10::cuda::CUDAGuard guard(h.device());
  fp8::HistoryRecordArgs a{h.data_ptr<float>() + row0 * h.stride(0), amax1.has_value() ? 2 : 1, h.size(1),
                           h.stride(0), h.stride(1), {amax0.data_ptr<float>(), nullptr, nullptr}};
  if (amax1.has_value()) a.amax[1] = amax1->data_ptr<float>();
  C10_CUDA_CHECK(fp8::history_record_cuda(a, c10::cuda::getCurrentCUDAStream()));
}

bool scaled_mm_takes(const at::Tensor& a, const at::Tensor& b, Scaling sa, Scaling sb, at::ScalarType out_dtype) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  if (m == 0 || k == 0 || n == 0) return false;
  if (a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2) return false;
  if (k % 16 != 0 || n % 16 != 0) return false;
  if (sa != Scaling::kBlock) return true;
  if (k % fp8::kBlockSize != 0 || m % 4 != 0 || out_dtype != at::kBFloat16) return false;
  // 128 x 128 scales: cuBLASLt's leading dimension round_up(K/128, 4) must
  // be our K/128, or only one N-block read (header comment).
  return sb != Scaling::kBlock2d || (k / fp8::kBlockSize) % 4 == 0 || n <= fp8::kBlockSize;
}

// lowbit's block-scaled GEMM (csrc/lowbit/fp8/sm90_fp8_block_gemm.cu), or
// nothing where it does not take the operands.
c10::optional<at::Tensor> own_block_gemm(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                                         const at::Tensor& scale_b, Scaling sb,
                                         const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  const bool bf16_out = out_dtype == at::kBFloat16;
  if (!bf16_out && out_dtype != at::kFloat) return c10::nullopt;
  const at::Tensor sa_c = scale_a.contiguous();
  // 1 x 128 B scales go in transposed, [K/128, N]: a K-block's scales of a
  // tile's columns are then one contiguous copy.
  const at::Tensor sb_c = sb == Scaling::kBlock ? scale_b.t().contiguous() : scale_b.contiguous();
  // The bias in FP32, whatever its dtype: added to the FP32 sum before the
  // output's one rounding.
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({m, n}, a.options().dtype(out_dtype));
  const auto format = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat8_e5m2 ? Format::kE5M2 : Format::kE4M3;
  };
  const fp8::BlockGemmArgs args{a.data_ptr(),
                                format(a),
                                b.data_ptr(),
                                format(b),
                                m,
                                n,
                                k,
                                sa_c.data_ptr<float>(),
                                sb_c.data_ptr<float>(),
                                sb,
                                bias.has_value() ? bias_f.data_ptr<float>() : nullptr,
                                bf16_out ? DType::kBFloat16 : DType::kFloat32,
                                y.data_ptr()};
  if (!fp8::block_gemm_takes(args)) return c10::nullopt;
  C10_CUDA_CHECK(fp8::block_gemm_cuda(args, c10::cuda::getCurrentCUDAStream()));
  return y;
}

at::Tensor gemm_cuda_impl(const at::Tensor& a_in, const at::Tensor& scale_a, const at::Tensor& b_in,
                          const at::Tensor& scale_b, Scaling sa, Scaling sb, const c10::optional<at::Tensor>& bias,
                          at::ScalarType out_dtype, bool fast_accum) {
  c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  if (!scaled_mm_takes(a, b, sa, sb, out_dtype)) {
    // Block scales cuBLASLt does not take (float32 outputs, M % 4 != 0, the
    // misread 128 x 128 scale layouts): lowbit's kernel, slower than
    // cuBLASLt's where both run (docs/perf/log/fp8_train.md, "Block GEMM").
    if (sa == Scaling::kBlock && a.numel() > 0 && b.numel() > 0) {
      if (c10::optional<at::Tensor> y = own_block_gemm(a, scale_a, b, scale_b, sb, bias, out_dtype)) return *y;
    }
    return gemm_reference(a, scale_a, b, scale_b, sa, sb, bias, out_dtype);
  }
  if (sa == Scaling::kRow && sb == Scaling::kRow) {
    // lowbit's form where it beats cuBLASLt's row-scaled GEMM (fp8_row_gemm_cuda.h).
    if (c10::optional<at::Tensor> y = own_row_gemm(a, scale_a, b, scale_b, bias, out_dtype, fast_accum)) return *y;
  }
  const int64_t m = a.size(0), n = b.size(0);
  at::Tensor sa_mm, sb_mm;
  switch (sa) {
    case Scaling::kTensor:
      sa_mm = scale_a.contiguous();
      sb_mm = scale_b.contiguous();
      break;
    case Scaling::kRow:
      sa_mm = scale_a.contiguous().view({m, 1});
      sb_mm = scale_b.contiguous().view({1, n});
      break;
    default:
      sa_mm = scale_a.t().contiguous().t();  // [M, K/128], strides (1, M)
      sb_mm = sb == Scaling::kBlock2d ? scale_b.contiguous().t()  // [K/128, N/128], strides (1, K/128)
                                      : scale_b.t().contiguous();  // [K/128, N], strides (N, 1)
      break;
  }
  const bool epilogue_bias = bias.has_value() && bias->scalar_type() == out_dtype && out_dtype != at::kFloat;
  c10::optional<at::Tensor> b_mm;
  if (epilogue_bias) b_mm = bias->contiguous();
  // Block scales: cuBLASLt applies each K-block's scales to the partial
  // sums, i.e. promotes them every 128 elements anyway; fast_accum is
  // ignored there.
  const bool fast = fast_accum && sa != Scaling::kBlock;
  at::Tensor y = at::_scaled_mm(a, b.t(), sa_mm, sb_mm, b_mm, c10::nullopt, out_dtype, fast);
  if (bias.has_value() && !epilogue_bias) y = (y.to(at::kFloat) + bias->to(at::kFloat)).to(out_dtype);
  return y;
}

at::Tensor transpose_codes_cuda(const at::Tensor& codes) {
  c10::cuda::CUDAGuard guard(codes.device());
  const at::Tensor c = codes.contiguous();
  const int64_t rows = c.size(0), cols = c.size(1);
  TORCH_CHECK_VALUE(cols <= fp8::kMaxTransposeCols, "lowbit.fp8_linear_forward: an FP8 operand's transposed copy is made for at most ",
                    fp8::kMaxTransposeCols, " columns, got ", cols);
  at::Tensor out = at::empty({cols, rows}, c.options());
  C10_CUDA_CHECK(fp8::transpose_codes_cuda(reinterpret_cast<const uint8_t*>(c.data_ptr()), rows, cols,
                                           reinterpret_cast<uint8_t*>(out.data_ptr()),
                                           c10::cuda::getCurrentCUDAStream()));
  return out;
}

const Backend kCudaBackend{&cast_cuda_impl,      &cast_into_cuda,        &gemm_cuda_impl,
                           &delayed_scales_cuda, &record_amax_cuda_impl, &transpose_codes_cuda};

CastTuple cast_cuda(const at::Tensor& input, c10::string_view scaling, c10::string_view dtype, bool transpose,
                    const c10::optional<at::Tensor>& scale, bool pow2_scales) {
  const CastRequest r = parse_cast(input, scaling, dtype, scale);
  check_supported_gpu(input, kCast);
  return as_tuple(cast_cuda_impl(input, r.scaling, r.format, transpose, scale, pow2_scales));
}

at::Tensor gemm_cuda(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b, const at::Tensor& scale_b,
                     c10::string_view scaling_a, c10::string_view scaling_b, const c10::optional<at::Tensor>& bias,
                     c10::optional<at::ScalarType> out_dtype, bool fast_accum) {
  const GemmRequest r = parse_gemm(a, scale_a, b, scale_b, scaling_a, scaling_b, bias, out_dtype);
  check_supported_gpu(a, kGemm);
  return gemm_cuda_impl(a, scale_a, b, scale_b, r.sa, r.sb, bias, r.out_dtype, fast_accum);
}

LinearForwardOut forward_cuda(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                              at::Tensor& amax_history, c10::string_view recipe, c10::string_view grad_dtype,
                              c10::string_view amax_compute, int64_t margin, bool pow2_scales, bool save_x_t,
                              bool save_w_t, const c10::optional<at::Tensor>& w_fp8,
                              const c10::optional<at::Tensor>& w_fp8_scale, const c10::optional<at::Tensor>& x_scale,
                              c10::optional<at::ScalarType> out_dtype, bool fp8_out, bool fast_accum,
                             const c10::optional<at::Tensor>& x_amax, const c10::optional<at::Tensor>& w_amax) {
  check_supported_gpu(x, "fp8_linear_forward");
  c10::cuda::CUDAGuard guard(x.device());
  return linear_forward(kCudaBackend, x, weight, bias, amax_history, recipe, grad_dtype, amax_compute, margin,
                        pow2_scales, save_x_t, save_w_t,
                        ForwardExtras{w_fp8, w_fp8_scale, x_scale, x_amax, w_amax, out_dtype, fp8_out, fast_accum});
}

void cache_weight_cuda(const at::Tensor& weight, at::Tensor& amax_history, at::Tensor& w_data, at::Tensor& w_scale,
                       at::Tensor& w_t_data, at::Tensor& w_t_scale, c10::string_view recipe,
                       c10::string_view amax_compute, int64_t margin, bool pow2_scales) {
  check_supported_gpu(weight, "fp8_linear_cache_weight");
  c10::cuda::CUDAGuard guard(weight.device());
  linear_cache_weight(kCudaBackend, weight, amax_history, w_data, w_scale, w_t_data, w_t_scale, recipe, amax_compute,
                      margin, pow2_scales);
}

LinearBackwardOut backward_cuda(const at::Tensor& dy, const at::Tensor& x_t, const at::Tensor& x_t_scale,
                                const at::Tensor& w_t, const at::Tensor& w_t_scale, at::Tensor& amax_history,
                                c10::string_view recipe, c10::string_view grad_dtype, c10::string_view amax_compute,
                                int64_t margin, bool pow2_scales, at::ScalarType weight_dtype,
                                c10::optional<at::ScalarType> bias_dtype, bool compute_dx, bool compute_dw) {
  check_supported_gpu(dy, "fp8_linear_backward");
  c10::cuda::CUDAGuard guard(dy.device());
  return linear_backward(kCudaBackend, dy, x_t, x_t_scale, w_t, w_t_scale, amax_history, recipe, grad_dtype,
                         amax_compute, margin, pow2_scales, weight_dtype, bias_dtype, compute_dx, compute_dw);
}

void record_amax_cuda(const at::Tensor& amax_history, int64_t row, const at::Tensor& amax) {
  check_supported_gpu(amax_history, "fp8_record_amax");
  c10::cuda::CUDAGuard guard(amax_history.device());
  record_amax_op(kCudaBackend, amax_history, row, amax);
}

at::Tensor delayed_scale_cuda(const at::Tensor& amax_history, int64_t row, c10::string_view amax_compute,
                              int64_t margin, bool pow2_scales, c10::string_view dtype) {
  check_supported_gpu(amax_history, "fp8_delayed_scale");
  c10::cuda::CUDAGuard guard(amax_history.device());
  return delayed_scale(kCudaBackend, amax_history, row, amax_compute, margin, pow2_scales, dtype);
}

}  // namespace
}  // namespace lowbit::ops::fp8ops

TORCH_LIBRARY_IMPL(lowbit, CUDA, m) {
  m.impl("fp8_cast", &lowbit::ops::fp8ops::cast_cuda);
  m.impl("fp8_gemm", &lowbit::ops::fp8ops::gemm_cuda);
  m.impl("fp8_linear_forward", &lowbit::ops::fp8ops::forward_cuda);
  m.impl("fp8_linear_backward", &lowbit::ops::fp8ops::backward_cuda);
  m.impl("fp8_linear_cache_weight", &lowbit::ops::fp8ops::cache_weight_cuda);
  m.impl("fp8_delayed_scale", &lowbit::ops::fp8ops::delayed_scale_cuda);
  m.impl("fp8_record_amax", &lowbit::ops::fp8ops::record_amax_cuda);
}
