// CUDA kernel of lowbit::nvfp4_moe: an adapter to the launcher in
// csrc/lowbit/moe/nvfp4_moe.cu. Its workspace (sorted order, work items, h and
// the per-pair expert outputs) comes from the caching allocator, sized from
// the shapes, so the op captures in CUDA graphs with no host synchronization.
// lowbit::_nvfp4_moe_with_plan runs the same with a plan string's overrides.
// From fp8_min_rows rows the FP8 path runs instead (nvfp4_moe.h, "The FP8
// path"): lowbit's kernels around two grouped FP8 GEMMs
// (at::_scaled_grouped_mm). nvfp4_moe_to_fp8: the Linear's conversion
// kernels per expert.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "checks.h"
#include "cuda_checks.h"
#include "linear_ops.h"
#include "moe_ops.h"

namespace lowbit::ops {
namespace {

// The align kernel keeps one int per expert in shared memory (48 KB).
constexpr int64_t kMaxExperts = 12288;

// The W4A16 kernels on checked inputs (check_moe, check_supported_gpu),
// with the choices `overrides` force (none for the public op).
at::Tensor moe_w4a16_cuda(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                          const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                          const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                          c10::optional<double> swiglu_limit, const nvfp4::moe::MoePlanOverrides& overrides) {
  TORCH_CHECK_VALUE(w13.size(0) <= kMaxExperts, "lowbit.nvfp4_moe: argument 'w13' may hold at most ", kMaxExperts,
                    " experts on CUDA, got ", w13.size(0));
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t m = x.size(0), h = x.size(1);
  at::Tensor out = at::empty({m, h}, x.options());
  if (m == 0) return out;
  auto xc = contiguous_aligned(x, 16);
  auto wts = topk_weights.contiguous();
  auto ids = topk_ids.contiguous();
  auto p13 = contiguous_aligned(w13, 16), s13 = contiguous_aligned(w13_scale, 16);
  auto p2 = contiguous_aligned(w2, 16), s2 = contiguous_aligned(w2_scale, 16);
  auto g13 = w13_global.contiguous(), g2 = w2_global.contiguous();
  nvfp4::moe::MoeArgs a = moe_args(xc, wts, ids, p13, s13, g13, p2, s2, g2, swiglu_limit, out);
  TORCH_CHECK_VALUE(nvfp4::moe::moe_max_work_items(a, overrides) <= nvfp4::moe::kMaxWorkItems,
                    "lowbit.nvfp4_moe: M * k = ", m * a.k, " (token, expert) pairs need more than ",
                    nvfp4::moe::kMaxWorkItems, " work items on CUDA; split 'x' into smaller batches");
  at::Tensor workspace =
      at::empty({nvfp4::moe::moe_workspace_bytes(a, overrides)}, x.options().dtype(at::kByte));
  C10_CUDA_CHECK(nvfp4::moe::moe_cuda(a, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream(), overrides));
  return out;
}

// The W4A16 kernels with the choices `overrides` force (_nvfp4_moe_with_plan).
at::Tensor moe_cuda_planned(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                            const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                            const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                            c10::optional<double> swiglu_limit, const nvfp4::moe::MoePlanOverrides& overrides) {
  check_moe(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit, true);
  check_supported_gpu(x, "nvfp4_moe");
  return moe_w4a16_cuda(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit,
                        overrides);
}

// [E, ...] -> [2E - 1, ...] with group 2i = expert i; the odd groups alias
// half-way between two experts and get no rows (split_offsets, nvfp4_moe.h).
// Needs an even stride(0) (split_keeps_alignment for the GEMM's 16 bytes).
at::Tensor with_empty_groups(const at::Tensor& t) {
  std::vector<int64_t> sizes = t.sizes().vec(), strides = t.strides().vec();
  sizes[0] = 2 * sizes[0] - 1;
  strides[0] /= 2;
  return t.as_strided(sizes, strides);
}

// Whether with_empty_groups(t) keeps every expert's group start 16-byte
// aligned, as torch's grouped GEMM needs (its TMA copies).
bool split_keeps_alignment(const at::Tensor& t) {
  return (t.stride(0) * static_cast<int64_t>(t.element_size())) % 32 == 0;
}

// The FP8 path on checked inputs (M > 0). Each expert's rows form one group
// of both grouped GEMMs (followed by an empty one at 129-256 rows per
// expert); rows past the last group are never written or read.
at::Tensor moe_fp8_cuda(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                        const at::Tensor& w13_fp8, const at::Tensor& w13_fp8_scale, const at::Tensor& w2_fp8,
                        const at::Tensor& w2_fp8_scale, c10::optional<double> swiglu_limit) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t m = x.size(0), h = x.size(1), k = topk_ids.size(1), e = w13_fp8.size(0);
  const int64_t inter = w13_fp8.size(1) / 2, pairs = m * k;
  const auto i32 = x.options().dtype(at::kInt), f32 = x.options().dtype(at::kFloat);
  const auto f8 = x.options().dtype(at::kFloat8_e4m3fn);
  auto xc = contiguous_aligned(x, 16);
  auto wts = topk_weights.contiguous(), ids = topk_ids.contiguous();
  // torch 2.11's grouped FP8 GEMM picks its tiles from rows(A) / groups:
  // 64-row tiles (the same for both accumulations) up to 128, above 256-row
  // tiles with the tensor cores' fast accumulation (no periodic promotion
  // into FP32; outputs within 1.6-2.3e-3 of the promoted ones, 1.18-1.42x
  // faster on the DeepSeek layers on an H200) and 128-row tiles without.
  // Groups of 129-256 rows waste most of a 256-row tile (DeepSeek-V3 at 4096
  // tokens, 143 rows per group with the shared expert: 1.24x BF16 on an H200
  // with them, 1.80x with exact accumulation; docs/perf/log/moe.md, "MoE
  // v14"), so there an empty group follows each expert's, which keeps the
  // 64-row tiles, and fast accumulation is taken wherever those run. The
  // GEMM takes fewer than 1024 groups (check_moe_fp8 holds E to that), so
  // the split needs E <= 512.
  // mat2 column-major [E, K, N]: the [E, N, K] codes transposed.
  at::Tensor w13_t = fp8_codes(w13_fp8).transpose(1, 2), w13_s = w13_fp8_scale;
  at::Tensor w2_t = fp8_codes(w2_fp8).transpose(1, 2), w2_s = w2_fp8_scale;
  const bool split = e > 1 && 2 * e - 1 < 1024 && pairs / e > 128 && pairs / (2 * e - 1) <= 128 &&
                     split_keeps_alignment(w13_t) && split_keeps_alignment(w2_t) && w13_s.stride(0) % 2 == 0 &&
                     w2_s.stride(0) % 2 == 0;
  const bool fast_accum = pairs / e <= 128 || split;
  at::Tensor scratch = at::empty({2 * e}, i32), offsets = at::empty({e}, i32), pair_row = at::empty({m, k}, i32);
  at::Tensor split_offsets = split ? at::empty({2 * e - 1}, i32) : at::Tensor();
  // The row scales with a zeroed tail of kScaleTail: torch's grouped GEMM
  // reads a whole row tile's scales for a group's last, partial tile (the
  // rows past the group unstored), so past the last group's end it read up
  // to a tile beyond the tensor (compute-sanitizer initcheck: reads of
  // unwritten memory in that kernel). Rows past offsets[E-1] (pairs of no
  // expert) are never written by the sort: zeroed too.
  constexpr int64_t kScaleTail = 256;  // the largest row tile
  at::Tensor x8 = at::empty({pairs, h}, f8);
  at::Tensor x_scale = at::zeros({pairs + kScaleTail}, f32).narrow(0, 0, pairs);
  nvfp4::moe::Fp8MoeSortArgs sa{};
  sa.x = xc.data_ptr();
  sa.dtype = to_lowbit_dtype(x.scalar_type());
  sa.topk_ids = ids.data_ptr<int32_t>();
  sa.m = m;
  sa.k = k;
  sa.e = e;
  sa.h = h;
  sa.counts = scratch.data_ptr<int32_t>();
  sa.cursor = sa.counts + e;
  sa.offsets = offsets.data_ptr<int32_t>();
  sa.split_offsets = split ? split_offsets.data_ptr<int32_t>() : nullptr;
  sa.pair_row = pair_row.data_ptr<int32_t>();
  sa.x_fp8 = reinterpret_cast<uint8_t*>(x8.data_ptr());
  sa.x_scale = x_scale.data_ptr<float>();
  C10_CUDA_CHECK(nvfp4::moe::fp8_moe_sort_cuda(sa, stream));
  const at::Tensor& groups = split ? split_offsets : offsets;
  if (split) {
    w13_t = with_empty_groups(w13_t);
    w13_s = with_empty_groups(w13_s);
    w2_t = with_empty_groups(w2_t);
    w2_s = with_empty_groups(w2_s);
  }
  at::Tensor gate_up = at::_scaled_grouped_mm(x8, w13_t, x_scale, w13_s, groups, c10::nullopt, c10::nullopt,
                                              at::kBFloat16, fast_accum);
  at::Tensor act = at::empty({pairs, inter}, f8);
  at::Tensor act_scale = at::zeros({pairs + kScaleTail}, f32).narrow(0, 0, pairs);
  nvfp4::moe::Fp8MoeActArgs aa{};
  aa.gate_up = gate_up.data_ptr();
  aa.offsets = sa.offsets;
  aa.rows = pairs;
  aa.e = e;
  aa.inter = inter;
  aa.has_limit = swiglu_limit.has_value();
  aa.swiglu_limit = aa.has_limit ? static_cast<float>(*swiglu_limit) : 0.f;
  aa.act_fp8 = reinterpret_cast<uint8_t*>(act.data_ptr());
  aa.act_scale = act_scale.data_ptr<float>();
  C10_CUDA_CHECK(nvfp4::moe::fp8_moe_act_cuda(aa, stream));
  at::Tensor y = at::_scaled_grouped_mm(act, w2_t, act_scale, w2_s, groups, c10::nullopt, c10::nullopt,
                                        at::kBFloat16, fast_accum);
  at::Tensor out = at::empty({m, h}, x.options());
  nvfp4::moe::Fp8MoeCombineArgs ca{};
  ca.y = y.data_ptr();
  ca.topk_weights = wts.data_ptr<float>();
  ca.pair_row = sa.pair_row;
  ca.m = m;
  ca.k = k;
  ca.h = h;
  ca.dtype = sa.dtype;
  ca.out = out.data_ptr();
  C10_CUDA_CHECK(nvfp4::moe::fp8_moe_combine_cuda(ca, stream));
  return out;
}

at::Tensor moe_cuda(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                    const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                    const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                    c10::optional<double> swiglu_limit, int64_t fp8_min_rows,
                    const c10::optional<at::Tensor>& w13_fp8, const c10::optional<at::Tensor>& w13_fp8_scale,
                    const c10::optional<at::Tensor>& w2_fp8, const c10::optional<at::Tensor>& w2_fp8_scale) {
  // Checked once here for both paths.
  check_moe(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit, true);
  check_moe_fp8(x, w13, fp8_min_rows, w13_fp8, w13_fp8_scale, w2_fp8, w2_fp8_scale);
  check_supported_gpu(x, "nvfp4_moe");
  if (!moe_uses_fp8(x.size(0), fp8_min_rows)) {
    return moe_w4a16_cuda(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global,
                          swiglu_limit, {});
  }
  TORCH_CHECK_VALUE(topk_ids.size(1) <= nvfp4::moe::kMaxFp8Slots, "lowbit.nvfp4_moe: the FP8 path on CUDA takes at "
                    "most ", nvfp4::moe::kMaxFp8Slots, " experts per token, got 'topk_ids' of shape ", topk_ids.sizes());
  c10::cuda::CUDAGuard guard(x.device());
  return moe_fp8_cuda(x, topk_weights, topk_ids, *w13_fp8, *w13_fp8_scale, *w2_fp8, *w2_fp8_scale, swiglu_limit);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_to_fp8_cuda(
    const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global, const at::Tensor& w2,
    const at::Tensor& w2_scale, const at::Tensor& w2_global) {
  check_supported_gpu(w13, "nvfp4_moe_to_fp8");
  c10::cuda::CUDAGuard guard(w13.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // The conversion's row maxima: one buffer for every expert, reused in
  // stream order; made at the first call, after moe_to_fp8 checked the shapes.
  at::Tensor row_amax;
  return moe_to_fp8(w13, w13_scale, w13_global, w2, w2_scale, w2_global, [&](nvfp4::gemm::Fp8WeightArgs& a) {
    if (!row_amax.defined()) {
      row_amax = at::empty({std::max(w13.size(1), w2.size(1))}, w13.options().dtype(at::kFloat));
    }
    a.row_amax = row_amax.data_ptr<float>();
    C10_CUDA_CHECK(nvfp4::gemm::fp8_weight_cuda(a, stream));
  });
}

at::Tensor moe_with_plan_cuda(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                              const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_global,
                              const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_global,
                              c10::optional<double> swiglu_limit, c10::string_view plan) {
  return moe_cuda_planned(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global,
                          swiglu_limit, parse_moe_plan(plan));
}

}  // namespace
}  // namespace lowbit::ops

TORCH_LIBRARY_IMPL(lowbit, CUDA, m) {
  m.impl("nvfp4_moe", &lowbit::ops::moe_cuda);
  m.impl("nvfp4_moe_to_fp8", &lowbit::ops::moe_to_fp8_cuda);
  m.impl("_nvfp4_moe_with_plan", &lowbit::ops::moe_with_plan_cuda);
}
