// CUDA kernels for NVFP4 quantize / dequantize.
//
// Quantize is memory bound. With a caller-given global scale it is one pass:
// each 8-element group (16 B of bf16) belongs to one thread, a pair of
// threads forms one 16-element block and exchanges its half-amax with a
// shuffle, each thread writes 4 bytes of codes (coalesced) and the even
// thread the scale byte. The per-element math avoids IEEE division (one
// reciprocal per block plus a correction step, see nvfp4_format.h).
// Without one, a first pass reduces amax per group (atomicMax on the float
// bits: |x| >= 0, so unsigned order is float order and NaN bits sort above
// inf, which gives the NaN-propagating max of the rule for free).
#include "lowbit/cuda_utils.cuh"
#include "lowbit/nvfp4_format.h"
#include "lowbit/nvfp4_quant.h"

namespace lowbit::nvfp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kGroupElems = 8;  // elements per thread and group
constexpr int kUnroll = 2;      // groups per thread in the quantize kernel

template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* __restrict__ input, int64_t group_elems,
                                                         float* __restrict__ amax) {
  const int g = blockIdx.y;
  const T* x = input + g * group_elems;
  float m = 0.f;
  for (int64_t i = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * kGroupElems; i < group_elems;
       i += int64_t(gridDim.x) * kThreads * kGroupElems) {
    float v[8];
    cuda::load8(x + i, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = nan_propagating_absmax(m, v[j]);
  }
  // Reduce as unsigned bits: same order as floats for |x|, NaN above inf.
  unsigned bits = float_bits(m);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, off));
  __shared__ unsigned warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = bits;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned b = warp_max[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) b = max(b, warp_max[w]);
    atomicMax(reinterpret_cast<unsigned*>(amax) + g, b);
  }
}

// Encodes one 8-element group whose pair partner (lane ^ 1) holds the other
// half of its 16-element block. Every lane of the warp must call it.
template <typename T>
__device__ __forceinline__ void quantize_group(const float (&x)[8], int64_t t, bool active, int64_t group_elems,
                                               const float* __restrict__ global_in, const float* __restrict__ amax,
                                               uint32_t* __restrict__ packed, uint8_t* __restrict__ block_scale,
                                               float* __restrict__ global_out) {
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) m = nan_propagating_absmax(m, x[j]);
  const float block_amax = nan_propagating_absmax(m, __shfl_xor_sync(0xffffffffu, m, 1));
  if (!active) return;
  const int64_t first = t * kGroupElems;
  const int64_t g = first / group_elems;
  const float s = global_in ? global_in[g] : global_scale_from_amax(amax[g]);
  const uint8_t scale = encode_block_scale(block_amax, s);
  const float d = s * e4m3_to_float(scale);
  const float r = reciprocal_rn(d);
  uint32_t codes = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) codes |= uint32_t(encode_element(x[j], d, r)) << (4 * j);
  packed[t] = codes;
  if ((t & 1) == 0) block_scale[t >> 1] = scale;
  if (first % group_elems == 0) global_out[g] = s;
}

// Each thread encodes kUnroll groups spaced a grid apart, loading all of them
// before any math so that several 16-byte loads are in flight per thread.
// The grid is sized so that the spacing (and total_groups8) is even: a block
// pair never straddles two threads' strides, and pair partners are always
// both in range or both out of range, keeping the shuffle uniform.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ input, int64_t total_groups8, int64_t group_elems,
                    const float* __restrict__ global_in, const float* __restrict__ amax,
                    uint32_t* __restrict__ packed, uint8_t* __restrict__ block_scale,
                    float* __restrict__ global_out) {
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t t0 = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  float x[kUnroll][8];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t t = t0 + u * stride;
    cuda::load8(input + (t < total_groups8 ? t : 0) * kGroupElems, x[u]);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t t = t0 + u * stride;
    quantize_group<T>(x[u], t, t < total_groups8, group_elems, global_in, amax, packed, block_scale, global_out);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint32_t* __restrict__ packed, const uint8_t* __restrict__ block_scale,
                      const float* __restrict__ global_scale, int64_t total_groups8, int64_t group_elems,
                      T* __restrict__ out) {
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= total_groups8) return;
  const int64_t first = t * kGroupElems;
  const uint32_t codes = __ldg(packed + t);
  const float b = e4m3_to_float(__ldg(block_scale + (t >> 1)));
  const float s = __ldg(global_scale + first / group_elems);
  float y[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) y[j] = decode_element((codes >> (4 * j)) & 0xfu, b, s);
  cuda::store8(out + first, y);
}

template <typename T>
cudaError_t quantize_typed(const QuantizeArgs& a, cudaStream_t stream) {
  const int64_t group_elems = a.rows * a.cols;
  const int64_t total = a.groups * group_elems;
  const T* in = static_cast<const T*>(a.input);
  if (total == 0) {
    if (a.groups == 0) return cudaSuccess;
    if (a.global_scale_in)
      return cudaMemcpyAsync(a.global_scale_out, a.global_scale_in, a.groups * sizeof(float),
                             cudaMemcpyDeviceToDevice, stream);
    return cudaMemsetAsync(a.global_scale_out, 0, a.groups * sizeof(float), stream);  // amax of nothing is 0
  }
  if (!a.global_scale_in) {
    cudaError_t err = cudaMemsetAsync(a.amax_workspace, 0, a.groups * sizeof(float), stream);
    if (err != cudaSuccess) return err;
    const int64_t per_group = cuda::ceil_div(group_elems, kThreads * kGroupElems);
    const int64_t target = cuda::ceil_div(int64_t(cuda::num_sms()) * 8, a.groups);
    dim3 grid(static_cast<unsigned>(per_group < target ? per_group : target), static_cast<unsigned>(a.groups));
    amax_kernel<T><<<grid, kThreads, 0, stream>>>(in, group_elems, a.amax_workspace);
  }
  const int64_t groups8 = total / kGroupElems;
  quantize_kernel<T><<<cuda::ceil_div(groups8, kThreads * kUnroll), kThreads, 0, stream>>>(
      in, groups8, group_elems, a.global_scale_in, a.amax_workspace, reinterpret_cast<uint32_t*>(a.packed),
      a.block_scale, a.global_scale_out);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dequantize_typed(const DequantizeArgs& a, cudaStream_t stream) {
  const int64_t group_elems = a.rows * a.cols;
  const int64_t groups8 = a.groups * group_elems / kGroupElems;
  if (groups8 == 0) return cudaSuccess;
  dequantize_kernel<T><<<cuda::ceil_div(groups8, kThreads), kThreads, 0, stream>>>(
      reinterpret_cast<const uint32_t*>(a.packed), a.block_scale, a.global_scale, groups8, group_elems,
      static_cast<T*>(a.output));
  return cudaGetLastError();
}

}  // namespace

cudaError_t quantize_cuda(const QuantizeArgs& a, cudaStream_t stream) {
  switch (a.input_dtype) {
    case DType::kFloat32: return quantize_typed<float>(a, stream);
    case DType::kFloat16: return quantize_typed<__half>(a, stream);
    case DType::kBFloat16: return quantize_typed<__nv_bfloat16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t dequantize_cuda(const DequantizeArgs& a, cudaStream_t stream) {
  switch (a.output_dtype) {
    case DType::kFloat32: return dequantize_typed<float>(a, stream);
    case DType::kFloat16: return dequantize_typed<__half>(a, stream);
    case DType::kBFloat16: return dequantize_typed<__nv_bfloat16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace lowbit::nvfp4
