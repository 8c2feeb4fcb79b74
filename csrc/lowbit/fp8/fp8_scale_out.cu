// fp8_scale_out.h: the scaling pass after the unit-scale FP8 GEMM.
#include "lowbit/fp8/fp8_scale_out.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "lowbit/arch/cuda_utils.cuh"

namespace lowbit::fp8 {
namespace {

constexpr int kThreads = 256;

__device__ float g_unit_scale = 1.f;  // never written

template <typename Out>
__device__ __forceinline__ float to_float(Out v) {
  if constexpr (std::is_same_v<Out, __nv_bfloat16>) return __bfloat162float(v);
  else return __half2float(v);
}

template <typename Out>
__device__ __forceinline__ uint2 pack4(const float (&v)[4]) {
  if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
    return make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
  } else {
    const __half2 lo = __floats2half2_rn(v[0], v[1]), hi = __floats2half2_rn(v[2], v[3]);
    return make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
  }
}

// One thread per 4 consecutive outputs of a row (n % 4 == 0).
template <typename Out>
__global__ void __launch_bounds__(kThreads)
    scale_out_kernel(const float4* __restrict__ acc, int64_t quads, int64_t row_quads,
                     const float* __restrict__ scale_a, const float* __restrict__ scale_b,
                     const Out* __restrict__ bias, uint2* __restrict__ out) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < quads; i += int64_t(gridDim.x) * kThreads) {
    const int64_t row = i / row_quads, col = (i - row * row_quads) * 4;
    const float4 a = __ldg(acc + i);
    const float sa = __ldg(scale_a + row);
    float v[4] = {a.x * sa * __ldg(scale_b + col), a.y * sa * __ldg(scale_b + col + 1),
                  a.z * sa * __ldg(scale_b + col + 2), a.w * sa * __ldg(scale_b + col + 3)};
    if (bias != nullptr) {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] += to_float(bias[col + j]);
    }
    out[i] = pack4<Out>(v);
  }
}

}  // namespace

cudaError_t scale_out_cuda(const ScaleOutArgs& a, cudaStream_t stream) {
  if (a.n % 4 != 0 || reinterpret_cast<uintptr_t>(a.acc) % 16 != 0 || reinterpret_cast<uintptr_t>(a.out) % 8 != 0)
    return cudaErrorInvalidValue;
  if (a.m == 0 || a.n == 0) return cudaSuccess;
  const int64_t quads = a.m * a.n / 4;
  // Enough CTAs for every SM several times over; the loop takes the rest.
  const int64_t needed = cuda::ceil_div(quads, kThreads);
  const unsigned blocks = unsigned(needed < 65536 ? needed : 65536);
  const auto* acc = reinterpret_cast<const float4*>(a.acc);
  auto* out = reinterpret_cast<uint2*>(a.out);
  if (a.out_dtype == DType::kBFloat16)
    scale_out_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(
        acc, quads, a.n / 4, a.scale_a, a.scale_b, static_cast<const __nv_bfloat16*>(a.bias), out);
  else if (a.out_dtype == DType::kFloat16)
    scale_out_kernel<__half><<<blocks, kThreads, 0, stream>>>(acc, quads, a.n / 4, a.scale_a, a.scale_b,
                                                              static_cast<const __half*>(a.bias), out);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

cudaError_t unit_scale_cuda(const float** ptr) {
  void* p = nullptr;
  const cudaError_t err = cudaGetSymbolAddress(&p, g_unit_scale);
  *ptr = static_cast<const float*>(p);
  return err;
}

}  // namespace lowbit::fp8
