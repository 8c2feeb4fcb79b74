// Shared pieces of the NVFP4 Linear bindings (CPU, CUDA and Meta kernels):
// validation and output shapes.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <tuple>

#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"

namespace lowbit::ops {

// K rounded up to the prepacked layout's 128-column tiles (symbolic sizes).
inline c10::SymInt padded_k_sym(const c10::SymInt& k) {
  return (k + (nvfp4::gemm::kTileK - 1)) / nvfp4::gemm::kTileK * nvfp4::gemm::kTileK;
}
// Columns of the prepacked scale tensor for K: (2 Kp - K) / 16, which record
// K (csrc/lowbit/linear/nvfp4_linear_layout.h).
inline c10::SymInt prepacked_scale_cols_sym(const c10::SymInt& k) {
  return (padded_k_sym(k) * 2 - k) / nvfp4::kBlockSize;
}
// The first N Kp/16 bytes of a prepacked scale tensor [N, (2 Kp - K)/16] as
// [N, Kp/16] (a view): the tiles' scales without the bytes that record K,
// for a stack of prepacked weights (the MoE's experts).
at::Tensor prepacked_scale_tiles(const at::Tensor& weight_scale, const c10::SymInt& k);

// Checks the checkpoint-layout weight [N, K/2] uint8 and its E4M3 (or uint8
// code) block scales [N, K/16]; N and K multiples of 16.
void check_prepack(const at::Tensor& weight, const at::Tensor& weight_scale);
// The prepacked weight [N, Kp/2] and scales [N, (2 Kp - K)/16] (the bytes
// after the tiles' N Kp/16 already filled) for the checkpoint weight.
std::tuple<at::Tensor, at::Tensor> empty_prepack_outputs(const at::Tensor& weight);
// Core arguments for contiguous weight / scales and the prepack outputs.
nvfp4::gemm::PrepackArgs prepack_args(const at::Tensor& weight, const at::Tensor& weight_scale,
                                      std::tuple<at::Tensor, at::Tensor>& out);
// Core arguments to unpack a contiguous prepacked weight into `out` [N, K]
// (its dtype: float32, bf16 or fp16), global scale included.
nvfp4::gemm::UnpackArgs unpack_args(const at::Tensor& weight, const at::Tensor& weight_scale,
                                    const at::Tensor& weight_global, at::Tensor& out);

// Checks the prepacked weight [N, Kp/2] uint8, scales [N, (2 Kp - K)/16]
// uint8 and global [] float32 of lowbit::nvfp4_unpack for K (a multiple of
// 16: the K they record; scales [N, Kp/16] of the earlier format, which do
// not record K, are taken for any K with that Kp) and the output dtype
// (float32, bf16 or fp16), all on one device.
void check_unpack(const at::Tensor& weight, const at::Tensor& weight_scale, const at::Tensor& weight_global,
                  const c10::SymInt& k, at::ScalarType dtype);

// Checks the prepacked weight and scales of lowbit::nvfp4_unprepack for K
// (a multiple of 16; as check_unpack), on one device.
void check_unprepack(const at::Tensor& weight, const at::Tensor& weight_scale, const c10::SymInt& k);
// The prepacked weight back in the checkpoint layout, on the host (the
// inputs on the CPU): codes uint8 [N, K/2], block scales float8_e4m3fn [N, K/16].
std::tuple<at::Tensor, at::Tensor> unprepacked_cpu(const at::Tensor& weight, const at::Tensor& weight_scale,
                                                   int64_t k);

// The checks of the Linear ops are the same for every device (CPU, CUDA,
// Meta), so that a graph traced with fake tensors runs on any of them.
//
// Checks x [..., K] bf16/fp16/fp32, the prepacked weight [N, Kp/2] and
// scales [N, (2 Kp - K)/16] (Kp = K rounded up to 128) prepacked for x's K,
// global [] fp32 and bias [N] in x's dtype, all on x's device,
// fp8_min_rows >= 0, and the cached FP8 weight: weight_fp8 [N, K]
// float8_e4m3fn (or uint8 codes) with weight_fp8_scale [N] float32, both or
// neither, only with fp8_min_rows > 0 (the FP8 path is what uses them).
void check_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                  const at::Tensor& weight_global, const c10::optional<at::Tensor>& bias, int64_t fp8_min_rows,
                  const c10::optional<at::Tensor>& weight_fp8 = c10::nullopt,
                  const c10::optional<at::Tensor>& weight_fp8_scale = c10::nullopt);
c10::SymDimVector linear_output_shape(const at::Tensor& x, const at::Tensor& weight);

// Checks x [..., G, K] (bf16/fp16/fp32), n_groups G >= 1, max_fused_rows
// >= 0 and the prepacked weight of G blocks of rows (each a multiple of 16)
// for K, all on x's device, for lowbit::nvfp4_grouped_linear; its output
// [..., G, N / G].
void check_grouped_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                          const at::Tensor& weight_global, int64_t n_groups, int64_t max_fused_rows);
c10::SymDimVector grouped_linear_output_shape(const at::Tensor& x, const at::Tensor& weight, int64_t n_groups);

// Whether a call of m rows runs the FP8 path (nvfp4_linear.h, the rule):
// fp8_min_rows > 0 and m >= fp8_min_rows.
inline bool linear_uses_fp8(int64_t m, int64_t fp8_min_rows) { return fp8_min_rows > 0 && m >= fp8_min_rows; }

// Checks the prepacked weight, scales and global of lowbit::nvfp4_to_fp8
// for K (as check_unpack), on one device.
void check_to_fp8(const at::Tensor& weight, const at::Tensor& weight_scale, const at::Tensor& weight_global,
                  const c10::SymInt& k);
// Its outputs: codes float8_e4m3fn [N, K] and row scales float32 [N].
std::tuple<at::Tensor, at::Tensor> empty_to_fp8_outputs(const at::Tensor& weight, const c10::SymInt& k);
// Core arguments for contiguous weight / scales / global and those outputs
// (row_amax left null: the CUDA binding sets its scratch).
nvfp4::gemm::Fp8WeightArgs to_fp8_args(const at::Tensor& weight, const at::Tensor& weight_scale,
                                       const at::Tensor& weight_global, std::tuple<at::Tensor, at::Tensor>& out);
// The cached FP8 weight as float8_e4m3fn (a view of uint8 codes).
at::Tensor fp8_codes(const at::Tensor& weight_fp8);

// The reference Linear in ATen ops on x's device (the CPU kernel; the CUDA
// kernel for float32 x, which the fused kernels and cuBLASLt's FP8 GEMM do
// not take): `unpack_fp32(global)` returns the weight [N, K] in FP32 times
// `global` (a float32 [] tensor); FP32 products, the bias added in FP32,
// the result in x's dtype.
at::Tensor linear_reference(const at::Tensor& x, const at::Tensor& weight_global,
                            const c10::optional<at::Tensor>& bias,
                            const std::function<at::Tensor(const at::Tensor&)>& unpack_fp32);
// x2 [M, K] (contiguous, on the CPU) rounded to E4M3 per row by the core's
// reference loops (nvfp4_linear.h, the rule): codes float8_e4m3fn [M, K]
// and row scales float32 [M].
std::tuple<at::Tensor, at::Tensor> fp8_rows_cpu_impl(const at::Tensor& x2);
// The FP8 path's product in ATen ops on their device: x8 [M, K] and w8
// [N, K] E4M3 codes with their row scales [M] and [N] (nvfp4_linear.h, the
// rule), the codes' products summed in FP32, times both scales, the bias
// added in FP32, one rounding to `dtype`; shaped `out_shape` ([..., N]).
at::Tensor fp8_linear_reference(const at::Tensor& x8, const at::Tensor& x_scale, const at::Tensor& w8,
                                const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                                at::IntArrayRef out_shape, at::ScalarType dtype);

// The overrides a plan string forces (csrc/lowbit/linear/sm90_linear_plan.h,
// "Overrides"), or ValueError naming `op` and the key.
nvfp4::gemm::LinearPlanOverrides parse_linear_plan(c10::string_view plan, const char* op);

// lowbit::_explain_linear_plan: which form runs (m, n, k) on CUDA device
// `device_index` ("key: value" lines: nvfp4::gemm::explain_linear_plan), or
// on the CPU (device_index -1). The op takes no tensor: one kernel serves
// every dispatch key.
std::string explain_linear_plan_op(int64_t m, int64_t n, int64_t k, int64_t device_index, c10::string_view plan);
#if defined(LOWBIT_WITH_CUDA)
// Its CUDA part (linear_ops_cuda.cpp): checks the device, then explains.
std::string explain_linear_plan_cuda(int64_t m, int64_t n, int64_t k, int64_t device_index,
                                     const nvfp4::gemm::LinearPlanOverrides& overrides);
#endif

}  // namespace lowbit::ops
