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
}
