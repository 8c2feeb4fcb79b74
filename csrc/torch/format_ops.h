// Shared pieces of the NVFP4 quantize / dequantize bindings: validation and
// output allocation used by the CPU, CUDA and Meta kernels alike.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "lowbit/format/nvfp4_format.h"
#include "lowbit/format/nvfp4_quant.h"

namespace lowbit::ops {

// Validates and returns (input, global_scale) made contiguous and aligned.
std::tuple<at::Tensor, c10::optional<at::Tensor>> prepare_quantize(const at::Tensor& input,
                                                                    const c10::optional<at::Tensor>& global_scale);

// A caller-given global scale must be positive and finite: raises
// ValueError naming the first bad value. Reads the values, so it runs on
// host tensors only (the CUDA kernel turns such scales into NaN instead).
void check_global_scale_values_cpu(const at::Tensor& global_scale);

// (packed, block_scale, global_scale) outputs for `input`, SymInt-aware.
std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_quantize_outputs(const at::Tensor& input);

// Core arguments for input [.., N, K] -> outputs; pointers left to fill.
nvfp4::QuantizeArgs quantize_args(const at::Tensor& input, const c10::optional<at::Tensor>& global_scale,
                                  std::tuple<at::Tensor, at::Tensor, at::Tensor>& out);

void check_dequantize(const at::Tensor& packed, const at::Tensor& block_scale, const at::Tensor& global_scale,
                      at::ScalarType out_dtype);
at::ScalarType dequantize_dtype(const c10::optional<at::ScalarType>& out_dtype);
nvfp4::DequantizeArgs dequantize_args(const at::Tensor& packed, const at::Tensor& block_scale,
                                      const at::Tensor& global_scale, at::Tensor& out);

}  // namespace lowbit::ops
