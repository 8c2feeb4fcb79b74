// The one place where lowbit's operator schemas are declared. Kernels for
// each dispatch key (CPU, CUDA, Meta) are registered beside their bindings,
// one file per op family (named in the comment above each group).
//
// Conventions (docs/ARCHITECTURE.md): functional ops; sizes derive from
// tensor shapes (SymInt where an explicit size is needed); mutated state is
// marked Tensor(a!) and never returned.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <string>

#include "linear_ops.h"

namespace {

std::string build_info() {
#if defined(LOWBIT_WITH_CUDA)
  return "cuda=1 arch=sm_90a";
#else
  return "cuda=0";
#endif
}

// Every op of the library (C++ schemas above and below; tests/python/
// test_build.py checks the list against the registered ops).
constexpr const char* kOps[] = {
    "build_info", "route", "dense_router", "hash_router", "topk", "nvfp4_quantize", "nvfp4_dequantize",
    "nvfp4_prepack", "nvfp4_unprepack", "nvfp4_linear", "_nvfp4_linear_with_plan", "nvfp4_grouped_linear",
    "nvfp4_unpack", "nvfp4_to_fp8", "_explain_linear_plan", "nvfp4_moe_prepack", "nvfp4_moe_unprepack",
    "nvfp4_moe", "nvfp4_moe_to_fp8", "_nvfp4_moe_with_plan", "fp8_cast", "fp8_gemm", "fp8_linear_forward",
    "fp8_delayed_scale", "fp8_record_amax", "fp8_linear_cache_weight", "fp8_linear_backward"};

// The Autocast kernel of every lowbit op: the op runs in the dtypes it is
// given (its schema says what it returns), and autocast must not reach the
// ATen ops inside its kernels either (a CPU reference's matmul, the
// unpack-then-cuBLAS path's linear would otherwise run in autocast's
// dtype). So autocast is excluded for the call and the op dispatched on.
void without_autocast(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  op.callBoxed(stack);
}

void register_without_autocast(torch::Library& m) {
  for (const char* name : kOps) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&without_autocast>());
}

}  // namespace

TORCH_LIBRARY(lowbit, m) {
  // Build flags of this library, e.g. "cuda=1 arch=sm_90a".
  m.def("build_info() -> str", &build_info);

  // MoE routing (routing_ops.cpp; math in csrc/lowbit/routing/routing.h). Returns
  // (weights float32 [M, k], ids int32 [M, k]), ids in descending score
  // order, ties to the lower expert index. score_func: "sqrtsoftplus"
  // (DeepSeek-V4), "sigmoid" (DeepSeek-V3) or "softmax". k, n_group and
  // topk_group are model configuration; M comes from the shapes.
  //   route:        logits [M, E] float32/bf16, bias [E] float32 (selects only).
  //   dense_router: hidden [M, H] and gate weight [E, H] (bf16 or float32);
  //                 logits in float32 (GPU: cuBLAS, float32 out, then route).
  //   hash_router:  token_ids [M] int64/int32, tid2eid [V, k] int32; weights
  //                 from the gate logits [M, E] (weighting "gate") or 1/k
  //                 ("uniform"). E is the width of logits, else n_experts
  //                 (required then). A token id outside [0, V) or a table
  //                 entry outside [0, E) raises on CPU; on the GPU that
  //                 token gets ids -1 and weights 0.
  //   topk:         input [R, C] float32/bf16, C <= 131072, k <= 2048 ->
  //                 (values [R, k] input dtype, indices int32 [R, k]).
  m.def("route(Tensor logits, Tensor? bias, int k, str score_func=\"sqrtsoftplus\", int n_group=1, int topk_group=1, bool renormalize=True, float routed_scaling_factor=1.0) -> (Tensor, Tensor)");
  m.def("dense_router(Tensor hidden, Tensor weight, Tensor? bias, int k, str score_func=\"sqrtsoftplus\", int n_group=1, int topk_group=1, bool renormalize=True, float routed_scaling_factor=1.0) -> (Tensor, Tensor)");
  m.def("hash_router(Tensor token_ids, Tensor tid2eid, Tensor? logits, str score_func=\"sqrtsoftplus\", str weighting=\"gate\", bool renormalize=True, float routed_scaling_factor=1.0, int? n_experts=None) -> (Tensor, Tensor)");
  m.def("topk(Tensor input, int k) -> (Tensor, Tensor)");

  // NVFP4 format (format_ops.cpp). input [N, K] or stacked experts
  // [E, N, K]; global_scale [] or [E] in the ModelOpt convention
  // (amax / 2688). Returns packed uint8 [..., K/2], float8_e4m3fn block
  // scales [..., K/16] and float32 global scale(s). Block scales may also be
  // passed as uint8 holding the same E4M3 codes.
  m.def("nvfp4_quantize(Tensor input, Tensor? global_scale=None) -> (Tensor, Tensor, Tensor)");
  m.def("nvfp4_dequantize(Tensor packed, Tensor block_scale, Tensor global_scale, ScalarType? out_dtype=None) -> Tensor");

  // NVFP4 Linear, W4A16 (linear_ops.cpp; layout in
  // csrc/lowbit/linear/nvfp4_linear_layout.h). nvfp4_prepack converts a checkpoint
  // weight (uint8 [N, K/2], E4M3 scales [N, K/16]) once, at load time, to
  // (uint8 [N, Kp/2], uint8 [N, (2 Kp - K)/16]), Kp = K rounded up to 128,
  // the same layout on every device; the shapes record K, which the ops
  // check against x's (or the argument k). nvfp4_linear: x [..., K] -> [..., N] in x's
  // dtype, y = x W^T * weight_global (+ bias [N], x's dtype). From
  // fp8_min_rows rows of x (0: never; the choice inside the op, so one graph
  // serves every M) it runs the FP8 path instead: W and x rounded to E4M3
  // per row, an FP8 GEMM (the rule: csrc/lowbit/linear/nvfp4_linear.h). W's
  // E4M3 form is weight_fp8 [N, K] / weight_fp8_scale float32 [N] when given
  // (made once by nvfp4_to_fp8; only with fp8_min_rows > 0), else made on
  // every such call. nvfp4_to_fp8: the prepacked weight for K in that form
  // (float8_e4m3fn [N, K], float32 row scales [N], the global folded in).
  // nvfp4_unpack: the prepacked weight dequantized, [N, K] in `dtype` (global
  // scale included, one rounding); nvfp4_linear's backward uses it.
  // nvfp4_unprepack: the inverse of nvfp4_prepack, back to the checkpoint
  // layout (codes uint8 [N, K/2], float8_e4m3fn block scales [N, K/16]) to
  // save a checkpoint; it runs on the host.
  m.def("nvfp4_prepack(Tensor weight, Tensor weight_scale) -> (Tensor, Tensor)");
  m.def("nvfp4_unprepack(Tensor weight, Tensor weight_scale, SymInt k) -> (Tensor, Tensor)");
  // nvfp4_grouped_linear: the block-diagonal Linear (DeepSeek-V4's o_a_proj):
  // x [..., G, K] -> [..., G, N / G], group g times weight rows [g N / G,
  // (g + 1) N / G) (prepacked like nvfp4_linear's), times weight_global.
  // Up to max_fused_rows rows of x (tokens times G) the CUDA kernel runs
  // one nvfp4_linear over all groups and keeps the diagonal blocks (decode:
  // the weight read once); the choice inside the op keeps one graph for
  // every token count.
  m.def("nvfp4_grouped_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor weight_global, int n_groups, "
        "int max_fused_rows=256) -> Tensor");
  m.def("nvfp4_unpack(Tensor weight, Tensor weight_scale, Tensor weight_global, SymInt k, ScalarType dtype) -> Tensor");
  m.def(
      "nvfp4_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor weight_global, Tensor? bias=None, "
      "int fp8_min_rows=0, Tensor? weight_fp8=None, Tensor? weight_fp8_scale=None) -> Tensor");
  m.def("nvfp4_to_fp8(Tensor weight, Tensor weight_scale, Tensor weight_global, SymInt k) -> (Tensor, Tensor)");
  // Private (tests and probes): nvfp4_linear with a plan string that forces
  // kernel choices of this call (csrc/lowbit/linear/sm90_linear_plan.h,
  // "Overrides"; "" is the shipped plan). The CPU has one path: the string
  // is checked, then unused. _explain_linear_plan: which kernel form runs
  // (m, n, k) on CUDA device `device_index` (-1: the CPU) and why, as
  // "key: value" lines (lowbit.explain_plan).
  m.def(
      "_nvfp4_linear_with_plan(Tensor x, Tensor weight, Tensor weight_scale, Tensor weight_global, "
      "Tensor? bias=None, int fp8_min_rows=0, str plan=\"\") -> Tensor");
  m.def("_explain_linear_plan(int m, int n, int k, int device_index, str plan=\"\") -> str",
        &lowbit::ops::explain_linear_plan_op);

  // NVFP4 MoE experts, W4A16 (moe_ops.cpp; kernels in
  // csrc/lowbit/moe/nvfp4_moe.cu). nvfp4_moe_prepack converts stacked checkpoint
  // experts (w13 uint8 [E, 2I, H/2] gate rows then up rows, w2 uint8
  // [E, H, I/2], E4M3 block scales [..., K/16]) once, at load time, to the
  // Linear's prepacked layout per expert with W13's gate / up rows
  // interleaved (same layout on every device). nvfp4_moe: x [M, H] ->
  // [M, H] in x's dtype, out[t] = sum_j topk_weights[t, j] *
  // W2_e(silu(min(g, L)) * clamp(u, -L, L)), [g; u] = W13_e x[t],
  // e = topk_ids[t, j], globals float32 [E]; no clamp when swiglu_limit is
  // None. Ids outside [0, E) raise on CPU; on CUDA that slot adds nothing.
  // nvfp4_moe_unprepack: the inverse of nvfp4_moe_prepack for hidden size H
  // and intermediate size I (the prepacked shapes pad them), on the host.
  m.def("nvfp4_moe_prepack(Tensor w13, Tensor w13_scale, Tensor w2, Tensor w2_scale) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("nvfp4_moe_unprepack(Tensor w13, Tensor w13_scale, Tensor w2, Tensor w2_scale, SymInt hidden_size, SymInt intermediate_size) -> (Tensor, Tensor, Tensor, Tensor)");
  // From fp8_min_rows rows of x (0: never; the choice inside the op, so one
  // graph serves every M) nvfp4_moe runs the FP8 path on the experts' E4M3
  // form that nvfp4_moe_to_fp8 makes once from the prepacked experts
  // (w13_fp8 [E, 2I, H] gate rows then up rows, w2_fp8 [E, H, I],
  // float8_e4m3fn, row scales float32 [E, 2I] / [E, H] with the globals
  // folded in; the rule: csrc/lowbit/moe/nvfp4_moe.h, "The FP8 path").
  m.def("nvfp4_moe(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13, Tensor w13_scale, Tensor w13_global, Tensor w2, Tensor w2_scale, Tensor w2_global, float? swiglu_limit=None, int fp8_min_rows=0, Tensor? w13_fp8=None, Tensor? w13_fp8_scale=None, Tensor? w2_fp8=None, Tensor? w2_fp8_scale=None) -> Tensor");
  m.def("nvfp4_moe_to_fp8(Tensor w13, Tensor w13_scale, Tensor w13_global, Tensor w2, Tensor w2_scale, Tensor w2_global) -> (Tensor, Tensor, Tensor, Tensor)");
  // Private (tests and probes): nvfp4_moe with a plan string that forces
  // kernel choices of this call (csrc/lowbit/moe/nvfp4_moe.h,
  // MoePlanOverrides; checked, then unused on the CPU).
  m.def("_nvfp4_moe_with_plan(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13, Tensor w13_scale, Tensor w13_global, Tensor w2, Tensor w2_scale, Tensor w2_global, float? swiglu_limit=None, str plan=\"\") -> Tensor");

  // FP8 training (fp8_ops.cpp; rules in csrc/lowbit/fp8/fp8_format.h,
  // recipes in docs/fp8.md). fp8_cast: input [M, K] bf16/fp16/fp32 ->
  // (data [M, K] float8_e4m3fn or float8_e5m2 (dtype "e4m3" / "e5m2"),
  // scale, data_t [K, M] (the transposed copy, scaled along its own rows:
  // [0] unless transpose), scale_t ([0] unless transpose), amax [] float32).
  // scaling "tensor" (scale []), "row" ([M]; scale_t [K]), "block" (1 x 128
  // tiles along K: [M, ceil(K/128)]; scale_t [K, ceil(M/128)]) or "block2d"
  // (128 x 128 tiles: [ceil(M/128), ceil(K/128)]; scale_t its transpose).
  // `scale` (float32 [], "tensor" only): quantize with it (delayed scaling).
  // fp8_gemm: y = dequant(a) dequant(b)^T (+ bias [N]), a [M, K], b [N, K]
  // FP8, FP32 accumulation, out_dtype bfloat16 (default), float16 or
  // float32; scalings (tensor, tensor), (row, row), (block, block) or
  // (block, block2d), the scale shapes as fp8_cast's. fast_accum: on a
  // Hopper GPU with tensor or row scales, the tensor cores' own accumulator
  // over the whole K (no promotion of partial sums to FP32; faster, about 14
  // significant bits; what TransformerEngine and torchao use for the
  // forward GEMM); ignored with block scales and on the CPU.
  m.def("fp8_cast(Tensor input, str scaling, str dtype=\"e4m3\", bool transpose=False, Tensor? scale=None, "
        "bool pow2_scales=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("fp8_gemm(Tensor a, Tensor scale_a, Tensor b, Tensor scale_b, str scaling_a=\"tensor\", "
        "str scaling_b=\"tensor\", Tensor? bias=None, ScalarType? out_dtype=None, bool fast_accum=False) -> Tensor");
  // The FP8 Linear, one op per direction (lowbit.fp8_linear connects them
  // for autograd). recipe "tensorwise", "delayed", "rowwise" or "blockwise";
  // grad_dtype "e4m3" or "e5m2" (dy). amax_history float32 [3, L] (rows x,
  // W, dy; column 0 the most recent) for "delayed", read before and updated
  // after each cast, in place; ignored (e.g. an empty tensor) otherwise.
  // fp8_linear_forward: x [M, K], weight [N, K] -> (y [M, N] in x's dtype,
  // x_t [K, M] FP8 and its scales (for the weight gradient; [0] unless
  // save_x_t), w_t [K, N] FP8 and its scales (for the input gradient; [0]
  // unless save_w_t)). fp8_linear_backward: dy [M, N] and those -> (dx
  // [M, K] in dy's dtype, dw [N, K] in weight_dtype, dbias [N] in
  // bias_dtype), each [0] when not asked for.
  // Forward extras: w_fp8 / w_fp8_scale, W's cast read from the weight
  // cache (then save_w_t must be False: the caller holds W's transposed
  // copy); x_scale: x is FP8 E4M3 with these scales (the FP8 output of the
  // layer before; save_x_t must be False; out_dtype required); out_dtype:
  // y's dtype (default x's); fp8_out: y leaves as FP8 E4M3 under the
  // recipe's activation scaling, current scaling, its scales the sixth
  // output (else [0]); fast_accum: as fp8_gemm's, for the forward GEMM;
  // x_amax ([] float32, with x_scale, "delayed" only): the amax of the
  // high-precision x the FP8 x was cast from, recorded in the history's x
  // row as a cast here would record it (the FP8 all-gather of
  // lowbit.fp8_parallel casts before the op); w_amax likewise for an FP8
  // W given in w_fp8 (with it, "delayed" only: W's row; FSDP2's FP8
  // all-gather of lowbit.fp8_fsdp casts W before the op).
  // fp8_delayed_scale: the scale "delayed" gives history row `row` ([],
  // float32) before the op's next cast: the row reduced by amax_compute,
  // then scale_from_amax with the format's fmax, margin and pow2.
  // fp8_record_amax: history row `row` records `amax` ([] float32) as the
  // ops do after a cast (the row rolls one column, column 0 gets the amax;
  // a non-finite amax records the row's previous most recent value): for a
  // cast made outside the ops (lowbit.fp8_parallel's split backward).
  // fp8_linear_cache_weight: W's cast (data [N, K], scales, the transposed
  // copy [K, N] and its scales) written in place into the cache buffers,
  // contiguous, of the shapes fp8_cast gives; "delayed": W's scale from row
  // 1 of the history, and W's amax recorded there. Nothing is returned.
  m.def("fp8_linear_forward(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) amax_history, str recipe, "
        "str grad_dtype=\"e4m3\", str amax_compute=\"max\", int margin=0, bool pow2_scales=False, "
        "bool save_x_t=True, bool save_w_t=True, Tensor? w_fp8=None, Tensor? w_fp8_scale=None, "
        "Tensor? x_scale=None, ScalarType? out_dtype=None, bool fp8_out=False, bool fast_accum=False, "
        "Tensor? x_amax=None, Tensor? w_amax=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("fp8_delayed_scale(Tensor amax_history, int row, str amax_compute=\"max\", int margin=0, "
        "bool pow2_scales=False, str dtype=\"e4m3\") -> Tensor");
  m.def("fp8_record_amax(Tensor(a!) amax_history, int row, Tensor amax) -> ()");
  m.def("fp8_linear_cache_weight(Tensor weight, Tensor(a!) amax_history, Tensor(b!) w_data, Tensor(c!) w_scale, "
        "Tensor(d!) w_t_data, Tensor(e!) w_t_scale, str recipe, str amax_compute=\"max\", int margin=0, "
        "bool pow2_scales=False) -> ()");
  m.def("fp8_linear_backward(Tensor dy, Tensor x_t, Tensor x_t_scale, Tensor w_t, Tensor w_t_scale, "
        "Tensor(a!) amax_history, str recipe, str grad_dtype=\"e4m3\", str amax_compute=\"max\", int margin=0, "
        "bool pow2_scales=False, ScalarType weight_dtype=float, ScalarType? bias_dtype=None, bool compute_dx=True, "
        "bool compute_dw=True) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lowbit, AutocastCPU, m) { register_without_autocast(m); }
TORCH_LIBRARY_IMPL(lowbit, AutocastCUDA, m) { register_without_autocast(m); }
