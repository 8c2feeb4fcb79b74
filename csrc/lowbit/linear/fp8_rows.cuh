// Device pieces of the E4M3 row rule (nvfp4_linear.h: fp8_absmax,
// fp8_row_reciprocal, fp8_row_scale), shared by the Linear's FP8 path
// (nvfp4_linear_fp8.cu) and the MoE's (csrc/lowbit/moe/nvfp4_moe_fp8.cu).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace lowbit::nvfp4::gemm {

// Round to nearest even E4M3 (values past 448 saturate; the rule never
// makes one past 448 by more than a rounding).
__device__ __forceinline__ uint32_t e4m3x4(const float (&v)[4]) {
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[0], v[1]), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[2], v[3]), __NV_SATFINITE, __NV_E4M3);
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

// The E4M3 codes of 8 values times r, as the 8 bytes of one store.
__device__ __forceinline__ uint2 e4m3x8(const float (&v)[8], float r) {
  const float a[4] = {v[0] * r, v[1] * r, v[2] * r, v[3] * r}, b[4] = {v[4] * r, v[5] * r, v[6] * r, v[7] * r};
  return make_uint2(e4m3x4(a), e4m3x4(b));
}

// max over the CTA (kThreads threads, a multiple of 32) of each thread's `v`
// (>= 0, not NaN), for every thread. `red`: kThreads / 32 floats of shared
// memory, free again when this returns to every thread.
template <int kThreads>
__device__ __forceinline__ float cta_max(float v, float* red) {
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < kThreads / 32; ++w) v = fmaxf(v, red[w]);
  __syncthreads();
  return v;
}

}  // namespace lowbit::nvfp4::gemm
