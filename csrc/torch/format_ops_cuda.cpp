// CUDA kernels of lowbit::nvfp4_quantize / nvfp4_dequantize: thin adapters
// from at::Tensor to the core launchers in csrc/lowbit/format/nvfp4_quant.cu.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "checks.h"
#include "cuda_checks.h"
#include "format_ops.h"

namespace lowbit::ops {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& input,
                                                             const c10::optional<at::Tensor>& global_scale) {
  check_supported_gpu(input, "nvfp4_quantize");
  auto [x, gs] = prepare_quantize(input, global_scale);
  c10::cuda::CUDAGuard guard(x.device());
  // A given scale that is not positive would negate or zero the tensor.
  // Checking it here would read it on the host (a sync, which CUDA graphs
  // cannot capture), so such a scale becomes NaN on the device: the NaN
  // propagates to the block scales and the returned global scale, and the
  // tensor dequantizes to NaN. (+inf already does: its codes are zeros
  // times an infinite scale.) The CPU kernel raises ValueError instead.
  if (gs.has_value()) gs = at::where(*gs > 0, *gs, std::numeric_limits<float>::quiet_NaN());
  auto out = empty_quantize_outputs(x);
  auto args = quantize_args(x, gs, out);
  at::Tensor amax;
  if (!gs.has_value()) {
    amax = at::empty({args.groups}, x.options().dtype(at::kFloat));
    args.amax_workspace = amax.data_ptr<float>();
  }
  C10_CUDA_CHECK(nvfp4::quantize_cuda(args, c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor dequantize_cuda(const at::Tensor& packed, const at::Tensor& block_scale, const at::Tensor& global_scale,
                           c10::optional<at::ScalarType> out_dtype) {
  check_supported_gpu(packed, "nvfp4_dequantize");
  const auto dtype = dequantize_dtype(out_dtype);
  check_dequantize(packed, block_scale, global_scale, dtype);
  c10::cuda::CUDAGuard guard(packed.device());
  auto p = contiguous_aligned(packed, 16);
  auto b = block_scale.contiguous();
  auto g = global_scale.contiguous();
  auto sizes = p.sizes().vec();
  sizes.back() *= 2;
  auto out = at::empty(sizes, p.options().dtype(dtype));
  C10_CUDA_CHECK(nvfp4::dequantize_cuda(dequantize_args(p, b, g, out), c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace lowbit::ops

TORCH_LIBRARY_IMPL(lowbit, CUDA, m) {
  m.impl("nvfp4_quantize", &lowbit::ops::quantize_cuda);
  m.impl("nvfp4_dequantize", &lowbit::ops::dequantize_cuda);
}
