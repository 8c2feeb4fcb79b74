// lowbit's split-K row-scaled FP8 GEMM (csrc/lowbit/fp8/fp8_split_gemm.h)
// as an ATen call, shared by fp8_gemm's row x row case and the NVFP4
// Linear's FP8 path: both run it instead of cuBLASLt's row-scaled GEMM
// where the output has too few tiles to fill the GPU.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

namespace lowbit::ops {

// y [m, n] = (a b^T) * scale_a[m] * scale_b[n] (+ bias) from contiguous E4M3
// codes a [m, k], b [n, k] and float32 row scales, when the split kernel
// takes the operands and splits K at least six ways on this device (an
// output of at most num_SMs / 6 tiles of 128 x 192, K of 24 or more
// 128-wide blocks); nothing
// otherwise (the caller runs cuBLASLt). bias: [n] of
// out_dtype (bfloat16 or float16).
c10::optional<at::Tensor> split_row_gemm(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                                         const at::Tensor& scale_b, const c10::optional<at::Tensor>& bias,
                                         at::ScalarType out_dtype, bool fast_accum);

}  // namespace lowbit::ops
