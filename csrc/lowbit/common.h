// Shared definitions of the torch-free core: host/device qualifiers, the
// element types the kernels accept, and bit casts usable on host and device.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LOWBIT_HD __host__ __device__ __forceinline__
#else
#define LOWBIT_HD inline
#endif

namespace lowbit {

// Element types of activations and dequantized outputs.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

LOWBIT_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

LOWBIT_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// The GPU code this library builds: sm_90a. Its arch-specific instructions
// (wgmma, setmaxnreg, tensor-copy multicast) run on compute capability 9.0
// only, so a CUDA kernel may be launched on a GPU iff this is true; later
// GPUs (Blackwell 10.x / 12.x) need code built for them (a future backend).
constexpr const char* kCudaArchBuilt = "sm_90a";
constexpr bool gpu_arch_supported(int major, int minor) { return major == 9 && minor == 0; }

LOWBIT_HD bool is_nan(float x) { return x != x; }

// max(|a|, b) that propagates NaN from either side: once a NaN is seen the
// result stays NaN, so a block or tensor holding a NaN is never hidden.
LOWBIT_HD float nan_propagating_absmax(float running, float x) {
#if defined(__CUDA_ARCH__)
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(running), "f"(fabsf(x)));
  return m;
#else
  float a = x < 0.f ? -x : x;
  if (is_nan(a) || is_nan(running)) return bits_float(0x7fc00000u);
  return a > running ? a : running;
#endif
}

}  // namespace lowbit
