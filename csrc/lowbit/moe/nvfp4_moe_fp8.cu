// The MoE's FP8 path around its two grouped FP8 GEMMs (nvfp4_moe.h, "The
// FP8 path"): the token rows rounded to E4M3 and grouped by expert, the
// clamped SwiGLU rounded to E4M3, and the weighted combine. Plain launches
// (no programmatic dependent launch): each kernel starts after the grid
// before it has finished, so every read here may be non-coherent.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/linear/fp8_rows.cuh"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/moe/nvfp4_moe.h"

namespace lowbit::nvfp4::moe {
namespace {

using gemm::cta_max;
using gemm::e4m3x8;
using gemm::fp8_absmax;
using gemm::fp8_row_reciprocal;
using gemm::fp8_row_scale;

constexpr int kThreads = 256;
constexpr int kScanThreads = 1024;
static_assert(kMaxFp8Slots % 4 == 0, "rows[] ends on a 16-byte boundary");

__global__ void __launch_bounds__(kThreads) count_kernel(const int32_t* __restrict__ ids, int64_t pairs, int64_t e,
                                                         int32_t* __restrict__ counts) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < pairs; i += int64_t(gridDim.x) * kThreads) {
    const int32_t id = __ldg(ids + i);
    if (id >= 0 && id < e) atomicAdd(counts + id, 1);
  }
}

// One CTA: offsets = inclusive prefix sum of counts, cursor = exclusive;
// split_offsets (if given) the same ends with an empty group after each
// expert's but the last. Thread t sums a contiguous chunk of experts, the
// CTA scans the chunk sums.
__global__ void __launch_bounds__(kScanThreads) offsets_kernel(const int32_t* __restrict__ counts, int64_t e,
                                                               int32_t* __restrict__ offsets,
                                                               int32_t* __restrict__ cursor,
                                                               int32_t* __restrict__ split_offsets) {
  __shared__ int32_t sums[kScanThreads];
  const int64_t chunk = (e + kScanThreads - 1) / kScanThreads;
  const int64_t begin = threadIdx.x * chunk, end = begin + chunk < e ? begin + chunk : e;
  int32_t mine = 0;
  for (int64_t i = begin; i < end; ++i) mine += counts[i];
  sums[threadIdx.x] = mine;
  __syncthreads();
  for (int d = 1; d < kScanThreads; d *= 2) {  // Hillis-Steele: sums[t] becomes the inclusive sum up to t
    const int32_t add = threadIdx.x >= d ? sums[threadIdx.x - d] : 0;
    __syncthreads();
    sums[threadIdx.x] += add;
    __syncthreads();
  }
  int32_t run = sums[threadIdx.x] - mine;
  for (int64_t i = begin; i < end; ++i) {
    cursor[i] = run;
    run += counts[i];
    offsets[i] = run;
    if (split_offsets != nullptr) {
      split_offsets[2 * i] = run;
      if (i + 1 < e) split_offsets[2 * i + 1] = run;
    }
  }
}

// One CTA per token: claims a row in its expert's group for each valid slot,
// then rounds the token's row to E4M3 (its amax first, then the codes from
// L2) and stores the codes and the scale at every claimed row.
template <typename T>
__global__ void __launch_bounds__(kThreads) sort_rows_kernel(const T* __restrict__ x,
                                                             const int32_t* __restrict__ ids, int64_t k, int64_t h,
                                                             int64_t e, int32_t* __restrict__ cursor,
                                                             int32_t* __restrict__ pair_row,
                                                             uint8_t* __restrict__ x_fp8,
                                                             float* __restrict__ x_scale) {
  __shared__ int32_t rows[kMaxFp8Slots];  // [k]; static: the compiler's wide reads stay inside it
  __shared__ float red[kThreads / 32];
  const int64_t t = blockIdx.x;
  for (int64_t j = threadIdx.x; j < k; j += kThreads) {
    const int32_t id = __ldg(ids + t * k + j);
    const int32_t row = id >= 0 && id < e ? atomicAdd(cursor + id, 1) : -1;
    rows[j] = row;
    pair_row[t * k + j] = row;
  }
  const T* src = x + t * h;
  const int64_t chunks = h / 8;
  float amax = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    float v[8];
    cuda::load8(src + 8 * c, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fp8_absmax(amax, v[i]);
  }
  amax = cta_max<kThreads>(amax, red);  // its barrier also publishes rows[]
  const float r = fp8_row_reciprocal(amax);
  for (int64_t j = threadIdx.x; j < k; j += kThreads) {
    if (rows[j] >= 0) x_scale[rows[j]] = fp8_row_scale(amax, 1.f);
  }
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    float v[8];
    cuda::load8(src + 8 * c, v);
    const uint2 codes = e4m3x8(v, r);
    for (int64_t j = 0; j < k; ++j) {
      if (rows[j] >= 0) reinterpret_cast<uint2*>(x_fp8 + int64_t(rows[j]) * h)[c] = codes;
    }
  }
}

// silu(min(gate, L)) * clamp(up, -L, L); comparisons keep NaN, as torch.clamp
// does (the W4A16 kernels' clamped_swiglu, nvfp4_moe.cu).
__device__ __forceinline__ float swiglu(float gate, float up, bool has_limit, float limit) {
  if (has_limit) {
    gate = gate > limit ? limit : gate;
    up = up > limit ? limit : (up < -limit ? -limit : up);
  }
  return gate / (1.f + expf(-gate)) * up;
}

__device__ __forceinline__ void swiglu8(const __nv_bfloat16* row, int64_t inter, int64_t c, bool has_limit,
                                        float limit, float (&a)[8]) {
  float g[8], u[8];
  cuda::load8(row + 8 * c, g);
  cuda::load8(row + inter + 8 * c, u);
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = swiglu(g[i], u[i], has_limit, limit);
}

// One CTA per row of gate_up (rows past the last expert's end return): the
// activations' amax, then their codes (the row again, from L2).
__global__ void __launch_bounds__(kThreads) act_kernel(const __nv_bfloat16* __restrict__ gate_up,
                                                       const int32_t* __restrict__ offsets, int64_t e,
                                                       int64_t inter, bool has_limit, float limit,
                                                       uint8_t* __restrict__ act_fp8,
                                                       float* __restrict__ act_scale) {
  __shared__ float red[kThreads / 32];
  const int64_t row = blockIdx.x;
  if (row >= __ldg(offsets + e - 1)) return;  // the whole CTA: no barrier is skipped by part of it
  const __nv_bfloat16* src = gate_up + row * 2 * inter;
  const int64_t chunks = inter / 8;
  float amax = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    float a[8];
    swiglu8(src, inter, c, has_limit, limit, a);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fp8_absmax(amax, a[i]);
  }
  amax = cta_max<kThreads>(amax, red);
  const float r = fp8_row_reciprocal(amax);
  if (threadIdx.x == 0) act_scale[row] = fp8_row_scale(amax, 1.f);
  uint2* dst = reinterpret_cast<uint2*>(act_fp8 + row * inter);
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    float a[8];
    swiglu8(src, inter, c, has_limit, limit, a);
    dst[c] = e4m3x8(a, r);
  }
}

// One CTA per token: out[t] = sum_j w[t, j] y[row of (t, j)], FP32 in slot order.
template <typename T>
__global__ void __launch_bounds__(kThreads) combine_kernel(const __nv_bfloat16* __restrict__ y,
                                                           const float* __restrict__ weights,
                                                           const int32_t* __restrict__ pair_row, int64_t k,
                                                           int64_t h, T* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const int64_t chunks = h / 8;
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t j = 0; j < k; ++j) {
      const int32_t row = __ldg(pair_row + t * k + j);
      if (row < 0) continue;
      const float w = __ldg(weights + t * k + j);
      float v[8];
      cuda::load8(y + int64_t(row) * h + 8 * c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += w * v[i];
    }
    T o[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = cuda::from_float<T>(acc[i]);
    *reinterpret_cast<uint4*>(out + t * h + 8 * c) = *reinterpret_cast<const uint4*>(o);
  }
}

}  // namespace

cudaError_t fp8_moe_sort_cuda(const Fp8MoeSortArgs& a, cudaStream_t stream) {
  if (a.m == 0 || a.k == 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(a.counts, 0, a.e * sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  const int64_t pairs = a.m * a.k;
  const unsigned count_blocks = unsigned(cuda::ceil_div(pairs, kThreads) < 1024 ? cuda::ceil_div(pairs, kThreads) : 1024);
  count_kernel<<<count_blocks, kThreads, 0, stream>>>(a.topk_ids, pairs, a.e, a.counts);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  offsets_kernel<<<1, kScanThreads, 0, stream>>>(a.counts, a.e, a.offsets, a.cursor, a.split_offsets);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (a.k > kMaxFp8Slots) return cudaErrorInvalidValue;
  if (a.dtype == DType::kBFloat16)
    sort_rows_kernel<<<unsigned(a.m), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(a.x), a.topk_ids,
                                                             a.k, a.h, a.e, a.cursor, a.pair_row, a.x_fp8,
                                                             a.x_scale);
  else if (a.dtype == DType::kFloat16)
    sort_rows_kernel<<<unsigned(a.m), kThreads, 0, stream>>>(static_cast<const __half*>(a.x), a.topk_ids, a.k,
                                                             a.h, a.e, a.cursor, a.pair_row, a.x_fp8, a.x_scale);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

cudaError_t fp8_moe_act_cuda(const Fp8MoeActArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  act_kernel<<<unsigned(a.rows), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(a.gate_up), a.offsets,
                                                        a.e, a.inter, a.has_limit, a.swiglu_limit, a.act_fp8,
                                                        a.act_scale);
  return cudaGetLastError();
}

cudaError_t fp8_moe_combine_cuda(const Fp8MoeCombineArgs& a, cudaStream_t stream) {
  if (a.m == 0) return cudaSuccess;
  const auto* y = static_cast<const __nv_bfloat16*>(a.y);
  if (a.dtype == DType::kBFloat16)
    combine_kernel<<<unsigned(a.m), kThreads, 0, stream>>>(y, a.topk_weights, a.pair_row, a.k, a.h,
                                                           static_cast<__nv_bfloat16*>(a.out));
  else if (a.dtype == DType::kFloat16)
    combine_kernel<<<unsigned(a.m), kThreads, 0, stream>>>(y, a.topk_weights, a.pair_row, a.k, a.h,
                                                           static_cast<__half*>(a.out));
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace lowbit::nvfp4::moe
