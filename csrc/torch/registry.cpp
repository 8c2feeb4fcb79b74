// The one place where lowbit's operator schemas are declared. Kernels for
// each dispatch key (CPU, CUDA, Meta) are registered beside their bindings,
// one file per op family (named in the comment above each group).
//
// Conventions (docs/ARCHITECTURE.md): functional ops; sizes derive from
// tensor shapes (SymInt where an explicit size is needed); mutated state is
// marked Tensor(a!) and never returned.
#include <torch/library.h>

#include <string>

namespace {

std::string build_info() {
#if defined(LOWBIT_WITH_CUDA)
  return "cuda=1 arch=sm_90a";
#else
  return "cuda=0";
#endif
}

}  // namespace

TORCH_LIBRARY(lowbit, m) {
  // Build flags of this library, e.g. "cuda=1 arch=sm_90a".
  m.def("build_info() -> str", &build_info);

  // NVFP4 format (nvfp4_quant_ops.cpp). input [N, K] or stacked experts
  // [E, N, K]; global_scale [] or [E] in the ModelOpt convention
  // (amax / 2688). Returns packed uint8 [..., K/2], float8_e4m3fn block
  // scales [..., K/16] and float32 global scale(s). Block scales may also be
  // passed as uint8 holding the same E4M3 codes.
  m.def("nvfp4_quantize(Tensor input, Tensor? global_scale=None) -> (Tensor, Tensor, Tensor)");
  m.def("nvfp4_dequantize(Tensor packed, Tensor block_scale, Tensor global_scale, ScalarType? out_dtype=None) -> Tensor");

  // NVFP4 Linear, W4A16 (nvfp4_linear_ops.cpp; layout in
  // csrc/lowbit/nvfp4_gemm_layout.h). nvfp4_prepack converts a checkpoint
  // weight (uint8 [N, K/2], E4M3 scales [N, K/16]) once, at load time, to
  // (uint8 [N, Kp/2], uint8 [N, Kp/16]), Kp = K rounded up to 128, the same
  // layout on every device. nvfp4_linear: x [..., K] -> [..., N] in x's
  // dtype, y = x W^T * weight_global (+ bias [N], x's dtype).
  m.def("nvfp4_prepack(Tensor weight, Tensor weight_scale) -> (Tensor, Tensor)");
  m.def("nvfp4_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor weight_global, Tensor? bias=None) -> Tensor");
}
