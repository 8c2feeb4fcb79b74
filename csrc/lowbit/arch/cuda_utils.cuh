// Device helpers shared by the CUDA kernels: element types, 8-wide vector
// loads/stores (16 bytes for 16-bit types), warp reductions, launch helpers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "lowbit/common.h"

namespace lowbit::cuda {

template <DType D> struct DeviceType;
template <> struct DeviceType<DType::kFloat32> { using type = float; };
template <> struct DeviceType<DType::kFloat16> { using type = __half; };
template <> struct DeviceType<DType::kBFloat16> { using type = __nv_bfloat16; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Module state: a kernel parameter pointing at data that no kernel writes
// while a chain of dependent launches runs (weights, block and global
// scales, bias: written when loaded). A kernel launched with
// launch_dependent overlaps the grid before it, whatever that grid is, so
// it may read non-coherently (__ldg, load8, a const __restrict__ pointer)
// only through a ReadOnly parameter; every other pointer it reads (x, ids,
// work items, partials, workspaces) it reads after wait_for_previous_grid()
// with coherent loads: plain dereferences of pointers without __restrict__,
// load8_coherent, cp.async, TMA. scripts/check_dependent_loads.py checks
// the SASS (docs/ARCHITECTURE.md, "Chained kernels").
template <typename T>
struct ReadOnly {
  const T* ptr;
  ReadOnly() = default;
  LOWBIT_HD ReadOnly(const T* p) : ptr(p) {}  // NOLINT: converts like the pointer it replaces
  LOWBIT_HD operator const T*() const { return ptr; }
  LOWBIT_HD const T* get() const { return ptr; }
};

namespace detail {
template <typename T>
__device__ __forceinline__ void widen8(const uint4& v, float (&out)[8]) {
  static_assert(sizeof(T) == 2, "16-bit element types");
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_float(e[i]);
}
// bf16 widens by a shift: one integer op per element.
template <>
__device__ __forceinline__ void widen8<__nv_bfloat16>(const uint4& v, float (&out)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void widen8(const float4& a, const float4& b, float (&out)[8]) {
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
}  // namespace detail

// Loads 8 consecutive elements starting at p (16-byte aligned for 16-bit
// types, 32-byte aligned for float) and widens them to float. Non-coherent
// (__ldg): only for data no grid writes while the kernel runs (see ReadOnly).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&out)[8]) {
  detail::widen8<T>(__ldg(reinterpret_cast<const uint4*>(p)), out);
}
template <>
__device__ __forceinline__ void load8<float>(const float* p, float (&out)[8]) {
  detail::widen8(__ldg(reinterpret_cast<const float4*>(p)), __ldg(reinterpret_cast<const float4*>(p) + 1), out);
}
// Coherent loads (plain ld.global) for data a previous grid may have
// written. Explicit: the compiler turns a plain dereference into a
// non-coherent load when it proves that nothing in the kernel writes the
// memory. volatile keeps them after wait_for_previous_grid().
__device__ __forceinline__ uint2 ld_coherent(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ld_coherent(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ float4 ld_coherent(const float4* p) {
  float4 v;
  asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

// load8 with coherent loads, for data a previous grid may have written.
template <typename T>
__device__ __forceinline__ void load8_coherent(const T* p, float (&out)[8]) {
  detail::widen8<T>(ld_coherent(reinterpret_cast<const uint4*>(p)), out);
}
template <>
__device__ __forceinline__ void load8_coherent<float>(const float* p, float (&out)[8]) {
  detail::widen8(ld_coherent(reinterpret_cast<const float4*>(p)), ld_coherent(reinterpret_cast<const float4*>(p) + 1),
                 out);
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&in)[8]) {
  static_assert(sizeof(T) == 2, "16-bit element types");
  uint4 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = from_float<T>(in[i]);
  *reinterpret_cast<uint4*>(p) = v;
}
template <>
__device__ __forceinline__ void store8<float>(float* p, const float (&in)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
}

// Stores 4 consecutive elements (8-byte aligned for 16-bit types, 16-byte
// aligned for float).
template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&in)[4]) {
  static_assert(sizeof(T) == 2, "16-bit element types");
  uint2 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = from_float<T>(in[i]);
  *reinterpret_cast<uint2*>(p) = v;
}
template <>
__device__ __forceinline__ void store4<float>(float* p, const float (&in)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
}

// Programmatic dependent launch (sm_90): a kernel launched with
// launch_dependent may start while the previous kernel in the stream is
// still running; it must call wait_for_previous_grid() before it reads what
// that kernel writes (a no-op when launched normally). The previous kernel
// lets it start early with allow_dependent_launch(). Both work inside CUDA
// graph capture. smem: dynamic shared memory bytes per CTA.
__device__ __forceinline__ void wait_for_previous_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_dependent_launch() { asm volatile("griddepcontrol.launch_dependents;"); }

// 64-bit flags between CTAs of one grid: a store that publishes the
// thread's earlier writes (and, after a CTA barrier, its CTA's), and the
// load that makes them visible to the reader.
__device__ __forceinline__ void st_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

namespace detail {
// A launch (programmatic dependent when `dependent`), in clusters of
// *cluster CTAs when given.
template <typename... Params, typename... Args>
cudaError_t launch_ex(void (*kernel)(Params...), dim3 grid, const dim3* cluster, dim3 block, size_t smem,
                      cudaStream_t stream, bool dependent, Args&&... args) {
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (dependent) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster->x;
    attr[n].val.clusterDim.y = cluster->y;
    attr[n++].val.clusterDim.z = cluster->z;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...);
}
}  // namespace detail

template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args&&... args) {
  return detail::launch_ex(kernel, grid, nullptr, block, smem, stream, true, static_cast<Args&&>(args)...);
}
// launch_dependent with the grid in clusters of `cluster` CTAs.
template <typename... Params, typename... Args>
cudaError_t launch_dependent_clusters(void (*kernel)(Params...), dim3 grid, dim3 cluster, dim3 block, size_t smem,
                                      cudaStream_t stream, Args&&... args) {
  return detail::launch_ex(kernel, grid, &cluster, block, smem, stream, true, static_cast<Args&&>(args)...);
}
// An ordinary stream-ordered launch (it starts after the previous kernel
// ends) with the grid in clusters of `cluster` CTAs.
template <typename... Params, typename... Args>
cudaError_t launch_clusters(void (*kernel)(Params...), dim3 grid, dim3 cluster, dim3 block, size_t smem,
                            cudaStream_t stream, Args&&... args) {
  return detail::launch_ex(kernel, grid, &cluster, block, smem, stream, false, static_cast<Args&&>(args)...);
}

// Streaming multiprocessors of the current device, cached per device.
int num_sms();
// Shared memory per SM of the current device (bytes), cached per device.
int smem_per_sm();

// Dynamic shared memory for a CTA that needs `bytes`, padded so that at
// most `ctas` of them fit on an SM (ctas <= 0: `bytes` as is; the CTA's
// static shared memory and other resources may allow fewer). The block
// scheduler packs a grid of fewer CTAs than the device holds onto as few SMs
// as their resources allow, leaving others idle; capping the CTAs per SM
// spreads such a grid over every SM (docs/perf/log/linear.md, Linear v13).
int smem_for_ctas_per_sm(int bytes, int ctas);

// Lets `kernel` launch with up to `bytes` of dynamic shared memory on the
// current device. The attribute belongs to the function on a device; it is
// set the first time (or when a launch needs more than was set), so a
// launch path pays a table lookup, not a driver call.
cudaError_t allow_dynamic_smem(const void* kernel, int bytes);
template <typename... Params>
cudaError_t allow_dynamic_smem(void (*kernel)(Params...), int bytes) {
  return allow_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
}

// How many clusters of `cluster` CTAs (threads and `smem` dynamic shared
// memory bytes each) of `kernel` the current device runs at once: a cluster
// needs its SMs in one GPC, so large clusters of large CTAs fit fewer times
// than the SMs alone say. Cached per kernel, device and cluster size.
int64_t resident_clusters(const void* kernel, int threads, int smem, int cluster);
template <typename... Params>
int64_t resident_clusters(void (*kernel)(Params...), int threads, int smem, int cluster) {
  return resident_clusters(reinterpret_cast<const void*>(kernel), threads, smem, cluster);
}

LOWBIT_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The most CTAs a grid may have along y or z (x allows 2^31 - 1).
constexpr int64_t kMaxGridDimYZ = 65535;

}  // namespace lowbit::cuda
