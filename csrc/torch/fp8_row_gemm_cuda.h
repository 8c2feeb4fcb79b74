// lowbit's form of the row-scaled FP8 GEMM, shared by fp8_gemm's row x row
// case and the NVFP4 Linear's FP8 path: where it beats cuBLASLt's
// row-scaled GEMM on the shape, it runs instead.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

namespace lowbit::ops {

// y [m, n] = (a b^T) * scale_a[m] * scale_b[n] (+ bias) from contiguous E4M3
// codes a [m, k], b [n, k] and float32 row scales, BF16 or FP16 out, bias
// [n] of out_dtype: on outputs of at most 2^20 elements (2^19 where K <
// 3072) with n % 4 == 0, cuBLASLt's per-tensor FP8 GEMM with both scales 1
// into FP32, then lowbit's scaling pass (csrc/lowbit/fp8/fp8_scale_out.h).
// Nothing otherwise: the caller runs cuBLASLt's row-scaled GEMM.
c10::optional<at::Tensor> own_row_gemm(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                                       const at::Tensor& scale_b, const c10::optional<at::Tensor>& bias,
                                       at::ScalarType out_dtype, bool fast_accum);

}  // namespace lowbit::ops
