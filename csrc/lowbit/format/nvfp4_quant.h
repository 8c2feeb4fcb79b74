// NVFP4 quantize / dequantize: argument structs and the CPU and CUDA entry
// points. Arguments are validated by the caller (csrc/torch does it); these
// functions trust shapes and pointers.
#pragma once

#include "lowbit/common.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace lowbit::nvfp4 {

// Quantizes `groups` independent [rows, cols] matrices (stacked experts, or
// groups = 1 for a plain weight), each with its own global scale.
struct QuantizeArgs {
  const void* input;           // [groups, rows, cols] contiguous, input_dtype
  DType input_dtype;
  int64_t groups, rows, cols;  // cols % 16 == 0
  const float* global_scale_in;  // [groups] caller-given scales, or null: s = amax / 2688
  uint8_t* packed;             // [groups, rows, cols / 2]  two E2M1 codes per byte
  uint8_t* block_scale;        // [groups, rows, cols / 16] E4M3 codes
  float* global_scale_out;     // [groups]
  float* amax_workspace;       // CUDA only, [groups] floats, when global_scale_in is null
};

struct DequantizeArgs {
  const uint8_t* packed;       // [groups, rows, cols / 2]
  const uint8_t* block_scale;  // [groups, rows, cols / 16]
  const float* global_scale;   // [groups]
  int64_t groups, rows, cols;
  void* output;                // [groups, rows, cols], output_dtype
  DType output_dtype;
};

void quantize_cpu(const QuantizeArgs& args);
void dequantize_cpu(const DequantizeArgs& args);

#if defined(LOWBIT_WITH_CUDA)
cudaError_t quantize_cuda(const QuantizeArgs& args, cudaStream_t stream);
cudaError_t dequantize_cuda(const DequantizeArgs& args, cudaStream_t stream);
#endif

}  // namespace lowbit::nvfp4
