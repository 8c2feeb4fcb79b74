// Shared pieces of the NVFP4 MoE bindings (CPU, CUDA and Meta kernels).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <tuple>

#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/moe/nvfp4_moe.h"

namespace lowbit::ops {

// Checks x [M, H] (bf16/fp16; fp32 too on CPU), topk_weights float32 [M, k],
// topk_ids int32 [M, k], the prepacked experts (w13 [E, 2I, Hp/2], w13_scale
// [E, 2I, Hp/16], w13_global float32 [E], w2 [E, H, Ip/2], w2_scale
// [E, H, Ip/16], w2_global [E]; I % 16 == 0), swiglu_limit > 0, one device.
void check_moe(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
               const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
               const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
               c10::optional<double> swiglu_limit, bool cuda);

// The FP8 arguments of lowbit::nvfp4_moe: fp8_min_rows >= 0 (0: never the
// FP8 path); with fp8_min_rows > 0, all of w13_fp8 [E, 2I, H] and w2_fp8
// [E, H, I] (float8_e4m3fn, or uint8 holding the codes), w13_fp8_scale
// float32 [E, 2I] and w2_fp8_scale [E, H] (lowbit::nvfp4_moe_to_fp8), on
// x's device; with 0, none of them.
void check_moe_fp8(const at::Tensor& x, const at::Tensor& w13, int64_t fp8_min_rows,
                   const c10::optional<at::Tensor>& w13_fp8, const c10::optional<at::Tensor>& w13_fp8_scale,
                   const c10::optional<at::Tensor>& w2_fp8, const c10::optional<at::Tensor>& w2_fp8_scale);
inline bool moe_uses_fp8(int64_t m, int64_t fp8_min_rows) { return fp8_min_rows > 0 && m >= fp8_min_rows; }

// lowbit::nvfp4_moe_to_fp8 on the weights' device: checks, outputs, and per
// expert and weight the core's conversion (nvfp4_linear.h, Fp8WeightArgs)
// run by `convert` (the CPU loops or the CUDA kernels; it fills row_amax
// where it needs one); W13's rows are put back in checkpoint order.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_to_fp8(
    const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global, const at::Tensor& w2,
    const at::Tensor& w2_scale, const at::Tensor& w2_global,
    const std::function<void(nvfp4::gemm::Fp8WeightArgs&)>& convert);

// The core's arguments for checked, contiguous tensors (x and the weights as
// the kernel needs them aligned) and an output like x.
nvfp4::moe::MoeArgs moe_args(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                             const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                             const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                             c10::optional<double> swiglu_limit, at::Tensor& out);

// The overrides a plan string forces (csrc/lowbit/moe/nvfp4_moe.h,
// MoePlanOverrides), or ValueError naming the key.
nvfp4::moe::MoePlanOverrides parse_moe_plan(c10::string_view plan);

}  // namespace lowbit::ops
