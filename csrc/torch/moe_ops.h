// Shared pieces of the NVFP4 MoE bindings (CPU, CUDA and Meta kernels).
#pragma once

#include <ATen/ATen.h>

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
