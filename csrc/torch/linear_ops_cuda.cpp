// CUDA kernels of lowbit::nvfp4_prepack / nvfp4_unpack / nvfp4_to_fp8 /
// nvfp4_linear: adapters to the core launchers in csrc/lowbit/linear/. gemm::linear_plan picks the
// kernel from M and the shape (the table in sm90_linear_plan.h: fused kernels up
// to 2048 rows) and the workspace it needs (FP32 split-K partials, the wide
// kernel's x image), taken from the caching allocator. Above that
// (LinearPath::kUnpack) the weight is unpacked to x's dtype (global scale
// included) into a temporary and cuBLAS runs through at::linear. From
// fp8_min_rows rows (when set) the FP8 path runs instead (linear_fp8_cuda),
// on the cached FP8 weight when the call passes one.
// lowbit::_nvfp4_linear_with_plan runs the same with a plan string's
// overrides (tests and probes).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda_checks.h"
#include "fp8_row_gemm_cuda.h"
#include "lowbit/linear/nvfp4_linear.h"
#include "linear_ops.h"

namespace lowbit::ops {
namespace {

namespace gemm = nvfp4::gemm;

std::tuple<at::Tensor, at::Tensor> prepack_cuda(const at::Tensor& weight, const at::Tensor& weight_scale) {
  check_supported_gpu(weight, "nvfp4_prepack");
  check_prepack(weight, weight_scale);
  c10::cuda::CUDAGuard guard(weight.device());
  auto w = weight.contiguous();
  auto s = weight_scale.contiguous();
  auto out = empty_prepack_outputs(w);
  C10_CUDA_CHECK(gemm::prepack_cuda(prepack_args(w, s, out), c10::cuda::getCurrentCUDAStream()));
  return out;
}

// The prepacked weight (16-byte aligned) unpacked into a new [N, K] tensor
// of `dtype`, global scale included.
at::Tensor unpacked_cuda(const at::Tensor& w, const at::Tensor& s, const at::Tensor& g, int64_t k,
                         at::ScalarType dtype, cudaStream_t stream) {
  at::Tensor out = at::empty({w.size(0), k}, w.options().dtype(dtype));
  if (out.numel() > 0) C10_CUDA_CHECK(gemm::unpack_cuda(unpack_args(w, s, g, out), stream));
  return out;
}

at::Tensor unpack_weight_cuda(const at::Tensor& weight, const at::Tensor& weight_scale,
                              const at::Tensor& weight_global, int64_t k, at::ScalarType dtype) {
  check_supported_gpu(weight, "nvfp4_unpack");
  check_unpack(weight, weight_scale, weight_global, k, dtype);
  c10::cuda::CUDAGuard guard(weight.device());
  return unpacked_cuda(contiguous_aligned(weight, 16), contiguous_aligned(weight_scale, 16),
                       weight_global.contiguous(), k, dtype, c10::cuda::getCurrentCUDAStream());
}

// A save-time conversion: on the host, then back to the weight's device.
std::tuple<at::Tensor, at::Tensor> unprepack_cuda(const at::Tensor& weight, const at::Tensor& weight_scale,
                                                  int64_t k) {
  check_unprepack(weight, weight_scale, k);
  auto [codes, scales] = unprepacked_cpu(weight.cpu(), weight_scale.cpu(), k);
  return {codes.to(weight.device()), scales.to(weight.device())};
}

// The fused kernels' arguments (no bias) for contiguous, aligned x, the
// prepacked weight, its global and the output [m, n].
gemm::LinearArgs fused_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& g,
                            at::Tensor& out, int64_t m, int64_t n, int64_t k) {
  gemm::LinearArgs a{};
  a.x = x.data_ptr();
  a.dtype = to_lowbit_dtype(x.scalar_type());
  a.weight = w.data_ptr<uint8_t>();
  a.scale = s.data_ptr<uint8_t>();
  a.global_scale = g.data_ptr<float>();
  a.out = out.data_ptr();
  a.m = m;
  a.n = n;
  a.k = k;
  return a;
}

// The weight's FP8 form (nvfp4_linear.h, the rule) by the kernels of
// csrc/lowbit/linear/nvfp4_linear_fp8.cu: codes [N, K] and row scales [N];
// w and s contiguous and 16-byte aligned.
std::tuple<at::Tensor, at::Tensor> to_fp8_impl(const at::Tensor& w, const at::Tensor& s, const at::Tensor& g,
                                               int64_t k, cudaStream_t stream) {
  auto out = empty_to_fp8_outputs(w, k);
  if (k == 0) {
    std::get<1>(out).zero_();  // amax 0, scale 0
    return out;
  }
  at::Tensor amax = at::empty({w.size(0)}, w.options().dtype(at::kFloat));
  gemm::Fp8WeightArgs a = to_fp8_args(w, s, g, out);
  a.row_amax = amax.data_ptr<float>();
  C10_CUDA_CHECK(gemm::fp8_weight_cuda(a, stream));
  return out;
}

std::tuple<at::Tensor, at::Tensor> to_fp8_cuda(const at::Tensor& weight, const at::Tensor& weight_scale,
                                               const at::Tensor& weight_global, int64_t k) {
  check_supported_gpu(weight, "nvfp4_to_fp8");
  check_to_fp8(weight, weight_scale, weight_global, k);
  c10::cuda::CUDAGuard guard(weight.device());
  return to_fp8_impl(contiguous_aligned(weight, 16), contiguous_aligned(weight_scale, 16), weight_global.contiguous(),
                     k, c10::cuda::getCurrentCUDAStream());
}

constexpr int64_t kFp8FastAccumMinRows = 128;

// The FP8 path: W's codes (cached, or made now) and x's (now) rounded per
// row by lowbit's kernels, then cuBLASLt's FP8 GEMM with the row scales and
// the bias in its epilogue (or, on small outputs, lowbit's unit-scale form:
// fp8_row_gemm_cuda.h); float32 x, which that GEMM does not output,
// gets the same codes multiplied in FP32 (fp8_linear_reference).
at::Tensor linear_fp8_cuda(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& s, const at::Tensor& g,
                           const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& weight_fp8,
                           const c10::optional<at::Tensor>& weight_fp8_scale, at::IntArrayRef out_shape,
                           cudaStream_t stream) {
  const int64_t m = x2.size(0), k = x2.size(1);
  at::Tensor w8, w_scale;
  if (weight_fp8.has_value()) {
    w8 = fp8_codes(*weight_fp8);
    w_scale = *weight_fp8_scale;
  } else {
    std::tie(w8, w_scale) = to_fp8_impl(w, s, g, k, stream);
  }
  at::Tensor x8 = at::empty({m, k}, x2.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor x_scale = at::empty({m}, x2.options().dtype(at::kFloat));
  gemm::Fp8RowsArgs xa{};
  xa.x = x2.data_ptr();
  xa.dtype = to_lowbit_dtype(x2.scalar_type());
  xa.m = m;
  xa.k = k;
  xa.out = reinterpret_cast<uint8_t*>(x8.data_ptr());
  xa.row_scale = x_scale.data_ptr<float>();
  C10_CUDA_CHECK(gemm::fp8_rows_cuda(xa, stream));
  if (x2.scalar_type() == at::kFloat) {
    return fp8_linear_reference(x8, x_scale, w8, w_scale, bias, out_shape, at::kFloat);
  }
  c10::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->contiguous();
  const at::Tensor w8c = w8.contiguous();
  // lowbit's form where it beats cuBLASLt's row-scaled GEMM (fp8_row_gemm_cuda.h).
  if (c10::optional<at::Tensor> y = own_row_gemm(x8, x_scale, w8c, w_scale, b, x2.scalar_type(),
                                                 m >= kFp8FastAccumMinRows))
    return y->view(out_shape);
  // _scaled_mm takes row-major A and column-major B: W's codes [N, K]
  // row-major are B^T; the scales [M, 1] and [1, N].
  const at::Tensor b_t = w8c.t(), sa = x_scale.view({m, 1});
  const at::Tensor sb = w_scale.contiguous().view({1, w8.size(0)});
  auto gemm = [&](bool fast_accum) {
    return at::_scaled_mm(x8, b_t, sa, sb, b, c10::nullopt, x2.scalar_type(), fast_accum).view(out_shape);
  };
  // From kFp8FastAccumMinRows rows, fast accumulation (the tensor cores' own
  // accumulator over all of K, no periodic promotion into FP32): on an H200
  // the GEMM ran 1.0-1.18x faster at 128-256 rows and 1.04-1.35x at 4096-16384,
  // outputs within 1.3-2.8e-3 of the promoted ones against the path's
  // 3.4-4.0e-2 from the E4M3 roundings (docs/perf/log/linear.md, "Linear
  // v35"). cuBLASLt's heuristic finds no such algorithm for some row-scaled
  // shapes (CUBLAS_STATUS_NOT_SUPPORTED, before any launch: M = 1, N = 1024,
  // K = 7168 with a bias); those run the exact form, which serves every shape.
  if (m >= kFp8FastAccumMinRows) {
    try {
      return gemm(true);
    } catch (const c10::Error&) {
      // no fast-accumulation algorithm for this shape: the exact form below
    }
  }
  return gemm(false);
}

// The Linear with the choices `overrides` force (none for the public op).
at::Tensor linear_cuda_planned(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                               const at::Tensor& weight_global, const c10::optional<at::Tensor>& bias,
                               int64_t fp8_min_rows, const c10::optional<at::Tensor>& weight_fp8,
                               const c10::optional<at::Tensor>& weight_fp8_scale,
                               const gemm::LinearPlanOverrides& overrides) {
  check_linear(x, weight, weight_scale, weight_global, bias, fp8_min_rows, weight_fp8, weight_fp8_scale);
  check_supported_gpu(x, "nvfp4_linear");
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t k = x.size(-1), n = weight.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  const int64_t m = c10::multiply_integers(out_shape.begin(), out_shape.end() - 1);
  if (m == 0 || n == 0 || k == 0) {  // no products: y = bias (or 0), as F.linear
    at::Tensor out = at::zeros(out_shape, x.options());
    if (bias.has_value() && out.numel() > 0) out.copy_(bias->expand_as(out));
    return out;
  }
  auto w = contiguous_aligned(weight, 16);
  auto s = contiguous_aligned(weight_scale, 16);
  auto g = weight_global.contiguous();
  if (linear_uses_fp8(m, fp8_min_rows)) {
    return linear_fp8_cuda(contiguous_aligned(x, 16).view({m, k}), w, s, g, bias, weight_fp8, weight_fp8_scale,
                           out_shape, stream);
  }
  if (x.scalar_type() == at::kFloat) {
    // The fused kernels take bf16/fp16 x: float32 x runs the CPU's formula
    // on the device (the weight unpacked to FP32, an FP32 matmul).
    return linear_reference(x, g, bias, [&](const at::Tensor& global) {
      return unpacked_cuda(w, s, global, k, at::kFloat, stream);
    });
  }
  at::Tensor x2 = contiguous_aligned(x, 16).view({m, k});
  const gemm::LinearPlan plan = gemm::linear_plan(m, n, k, overrides);
  if (plan.path == gemm::LinearPath::kUnpack) {
    return at::linear(x2, unpacked_cuda(w, s, g, k, x.scalar_type(), stream), bias).view(out_shape);
  }
  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor workspace;
  gemm::LinearArgs a = fused_args(x2, w, s, g, out, m, n, k);
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    a.bias = b.data_ptr();
  }
  if (plan.workspace_bytes > 0) {
    workspace = at::empty({plan.workspace_bytes}, x.options().dtype(at::kByte));
    a.workspace = workspace.data_ptr();
  }
  C10_CUDA_CHECK(gemm::linear_fused_cuda(a, plan, stream));
  return out.view(out_shape);
}

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                       const at::Tensor& weight_global, const c10::optional<at::Tensor>& bias, int64_t fp8_min_rows,
                       const c10::optional<at::Tensor>& weight_fp8, const c10::optional<at::Tensor>& weight_fp8_scale) {
  return linear_cuda_planned(x, weight, weight_scale, weight_global, bias, fp8_min_rows, weight_fp8, weight_fp8_scale,
                             {});
}

at::Tensor linear_with_plan_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                                 const at::Tensor& weight_global, const c10::optional<at::Tensor>& bias,
                                 int64_t fp8_min_rows, c10::string_view plan) {
  return linear_cuda_planned(x, weight, weight_scale, weight_global, bias, fp8_min_rows, c10::nullopt, c10::nullopt,
                             parse_linear_plan(plan, "_nvfp4_linear_with_plan"));
}

// Up to max_fused_rows rows of x (tokens times G): one nvfp4_linear over all
// groups, every token's G slices against the whole weight, the diagonal
// blocks kept (G times the products, but the weight read once: decode).
// Above, the wgmma kernel, each W block on its group's columns of x, where
// groups are whole 128-row W blocks and K whole k-tiles (DeepSeek-V4's
// o_a_proj), up to kGroupedWgmmaMaxM tokens; otherwise (and for float32 x)
// the weight unpacked to x's dtype and one batched matmul.
at::Tensor grouped_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                               const at::Tensor& weight_global, int64_t n_groups, int64_t max_fused_rows) {
  check_grouped_linear(x, weight, weight_scale, weight_global, n_groups, max_fused_rows);
  check_supported_gpu(x, "nvfp4_grouped_linear");
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t k = x.size(-1), n = weight.size(0) / n_groups;
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  const int64_t m = x.numel() / std::max<int64_t>(n_groups * k, 1);
  if (x.numel() == 0 || k == 0) return at::zeros(out_shape, x.options());
  auto w = contiguous_aligned(weight, 16);
  auto s = contiguous_aligned(weight_scale, 16);
  auto g = weight_global.contiguous();
  if (m * n_groups <= max_fused_rows) {
    at::Tensor every = linear_cuda(x.reshape({m * n_groups, k}), weight, weight_scale, weight_global, c10::nullopt, 0,
                                   c10::nullopt, c10::nullopt);
    // Contiguous, as the Meta kernel says: compiled graphs and AOTInductor
    // packages read the output by the strides the Meta kernel gives.
    return every.view({m, n_groups, n_groups, n}).diagonal(0, 1, 2).transpose(1, 2).contiguous().view(out_shape);
  }
  at::Tensor x3 = contiguous_aligned(x, 16).view({m, n_groups, k});
  if (n % gemm::kWgmmaBlockRows != 0 || k % gemm::kTileK != 0 || m > gemm::kGroupedWgmmaMaxM ||
      x.scalar_type() == at::kFloat) {
    at::Tensor wg = unpacked_cuda(w, s, g, k, x.scalar_type(), stream).view({n_groups, n, k});
    return at::bmm(x3.transpose(0, 1), wg.transpose(1, 2)).transpose(0, 1).contiguous().view(out_shape);
  }
  at::Tensor out = at::empty({m, n_groups * n}, x.options());
  const gemm::LinearArgs a = fused_args(x3, w, s, g, out, m, n_groups * n, k);
  C10_CUDA_CHECK(gemm::grouped_linear_wgmma_cuda(a, n, stream));
  return out.view(out_shape);
}

}  // namespace

std::string explain_linear_plan_cuda(int64_t m, int64_t n, int64_t k, int64_t device_index,
                                     const gemm::LinearPlanOverrides& overrides) {
  const int64_t count = at::cuda::device_count();
  TORCH_CHECK_VALUE(device_index < count, "lowbit.explain_plan: no CUDA device ", device_index, " (", count,
                    " visible); device 'cpu' explains the CPU kernel");
  const auto device = static_cast<c10::DeviceIndex>(device_index);
  check_supported_gpu(device, "explain_plan");
  c10::cuda::CUDAGuard guard(device);  // the plan reads the current device's SMs and occupancy
  return gemm::explain_linear_plan(m, n, k, overrides);
}

}  // namespace lowbit::ops

TORCH_LIBRARY_IMPL(lowbit, CUDA, m) {
  m.impl("nvfp4_prepack", &lowbit::ops::prepack_cuda);
  m.impl("nvfp4_unpack", &lowbit::ops::unpack_weight_cuda);
  m.impl("nvfp4_unprepack", &lowbit::ops::unprepack_cuda);
  m.impl("nvfp4_to_fp8", &lowbit::ops::to_fp8_cuda);
  m.impl("nvfp4_grouped_linear", &lowbit::ops::grouped_linear_cuda);
  m.impl("nvfp4_linear", &lowbit::ops::linear_cuda);
  m.impl("_nvfp4_linear_with_plan", &lowbit::ops::linear_with_plan_cuda);
}
