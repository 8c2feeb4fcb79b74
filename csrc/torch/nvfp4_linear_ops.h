// Shared pieces of the NVFP4 Linear bindings (CPU, CUDA and Meta kernels):
// validation and output shapes.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "lowbit/nvfp4_gemm.h"
#include "lowbit/nvfp4_gemm_layout.h"

namespace lowbit::ops {

// K rounded up to the prepacked layout's 128-column tiles (symbolic sizes).
inline c10::SymInt padded_k_sym(const c10::SymInt& k) {
  return (k + (nvfp4::gemm::kTileK - 1)) / nvfp4::gemm::kTileK * nvfp4::gemm::kTileK;
}

// Checks the checkpoint-layout weight [N, K/2] uint8 and its E4M3 (or uint8
// code) block scales [N, K/16]; N and K multiples of 16.
void check_prepack(const at::Tensor& weight, const at::Tensor& weight_scale);
std::tuple<at::Tensor, at::Tensor> empty_prepack_outputs(const at::Tensor& weight);
// Core arguments for contiguous weight / scales and the prepack outputs.
nvfp4::gemm::PrepackArgs prepack_args(const at::Tensor& weight, const at::Tensor& weight_scale,
                                      std::tuple<at::Tensor, at::Tensor>& out);
// Core arguments to unpack a contiguous prepacked weight into `out` [N, K]
// (its dtype: float32, bf16 or fp16), global scale included.
nvfp4::gemm::UnpackArgs unpack_args(const at::Tensor& weight, const at::Tensor& weight_scale,
                                    const at::Tensor& weight_global, at::Tensor& out);

// Checks the prepacked weight [N, Kp/2] uint8, scales [N, Kp/16] uint8 and
// global [] float32 of lowbit::nvfp4_unpack for K (a multiple of 16) and the
// output dtype (float32, bf16 or fp16), all on one device.
void check_unpack(const at::Tensor& weight, const at::Tensor& weight_scale, const at::Tensor& weight_global,
                  const c10::SymInt& k, at::ScalarType dtype);

// Checks the prepacked weight and scales of lowbit::nvfp4_unprepack for K
// (a multiple of 16), on one device.
void check_unprepack(const at::Tensor& weight, const at::Tensor& weight_scale, const c10::SymInt& k);
// The prepacked weight back in the checkpoint layout, on the host (the
// inputs on the CPU): codes uint8 [N, K/2], block scales float8_e4m3fn [N, K/16].
std::tuple<at::Tensor, at::Tensor> unprepacked_cpu(const at::Tensor& weight, const at::Tensor& weight_scale,
                                                   int64_t k);

// Checks x [..., K] bf16/fp16/fp32 (fp32 on CPU only), the prepacked weight
// [N, Kp/2] and scales [N, Kp/16] (Kp = K rounded up to 128), global [] fp32
// and bias [N] in x's dtype, all on x's device, and fp8_min_rows >= 0.
void check_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                  const at::Tensor& weight_global, const c10::optional<at::Tensor>& bias, int64_t fp8_min_rows,
                  bool cuda);
c10::SymDimVector linear_output_shape(const at::Tensor& x, const at::Tensor& weight);

// Checks x [..., G, K] (bf16/fp16; fp32 too on CPU), n_groups G >= 1 and the
// prepacked weight of G blocks of rows (each a multiple of 16) for K, all
// on x's device, for lowbit::nvfp4_grouped_linear; its output [..., G, N / G].
void check_grouped_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                          const at::Tensor& weight_global, int64_t n_groups, bool cuda);
c10::SymDimVector grouped_linear_output_shape(const at::Tensor& x, const at::Tensor& weight, int64_t n_groups);

// Whether a call of m rows runs the FP8 mode (nvfp4_gemm.h, Fp8WeightArgs):
// fp8_min_rows > 0 and m >= fp8_min_rows.
inline bool linear_uses_fp8(int64_t m, int64_t fp8_min_rows) { return fp8_min_rows > 0 && m >= fp8_min_rows; }

}  // namespace lowbit::ops
