// CUDA kernels for NVFP4 quantize / dequantize.
//
// All kernels use a 2-D grid: blockIdx.y is the group (expert), blockIdx.x
// strides over that group's 8-element chunks, so no thread ever divides a
// 64-bit index (an emulated division costs ~70 instructions, more than the
// whole per-element encode).
//
// Quantize is memory bound. With a caller-given global scale it is one pass:
// one thread per 16-element block (two 16-byte loads of bf16), writing 8
// bytes of codes and the scale byte (both contiguous across the warp). Per
// element there is no IEEE division: one reciprocal per block plus a
// correction step (nvfp4_format.h). Without a given scale, a first pass
// reduces amax per group (atomicMax on the float bits: |x| >= 0, so unsigned
// order is float order and NaN bits sort above inf, which is the
// NaN-propagating max of the rule for free).
#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/format/nvfp4_format.h"
#include "lowbit/format/nvfp4_quant.h"

namespace lowbit::nvfp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 8;   // elements per thread and chunk
constexpr int kUnroll = 2;  // quantize: blocks per thread, loaded before any math

template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* __restrict__ input, int64_t group_chunks,
                                                         float* __restrict__ amax) {
  const int g = blockIdx.y;
  const T* x = input + g * group_chunks * kChunk;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  float m = 0.f;
  for (int64_t c = int64_t(blockIdx.x) * kThreads + threadIdx.x; c < group_chunks; c += 4 * stride) {
    float v[4][8];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t cu = c + u * stride;
      cuda::load8(x + (cu < group_chunks ? cu : c) * kChunk, v[u]);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int j = 0; j < 8; ++j) m = nan_propagating_absmax(m, v[u][j]);
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

// E2M1 code of q = RN(x / d) in the common case: x finite and |x| * r
// finite, so q is finite. The sign comes from x, not q: for x = -0 the
// correction step computes (+0) + (-0) = +0. Matches encode_element bit for
// bit there, in ~16 instructions.
__device__ __forceinline__ uint32_t encode_element_finite(float x, float d, float r) {
  const float q0 = __fmul_rn(x, r);
  const float q = __fmaf_rn(__fmaf_rn(-q0, d, x), r, q0);
  const float a = fabsf(q);
  const float scale = a >= 4.f ? 0.5f : (a >= 2.f ? 1.f : 2.f);
  const uint32_t offset = a >= 4.f ? 4u : (a >= 2.f ? 2u : 0u);
  const uint32_t code = min(static_cast<uint32_t>(__float2int_rn(a * scale)) + offset, 7u);
  return code | ((__float_as_uint(x) >> 28) & 8u);
}

// Codes of one 16-element block (8 bytes, element 2j in the low nibble of
// byte j) given its amax, divisor d and r = 1/d.
__device__ __forceinline__ uint2 encode_block(const float (&x)[kBlockSize], float block_amax, float d, float r) {
  uint32_t lo = 0, hi = 0;
  if (reciprocal_division_ok(d) && block_amax * r < 0x1p127f) {  // false for NaN/inf blocks
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      lo |= encode_element_finite(x[j], d, r) << (4 * j);
      hi |= encode_element_finite(x[j + 8], d, r) << (4 * j);
    }
  } else {
    // non-finite input or degenerate scales (0, inf, NaN, extreme)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      lo |= uint32_t(encode_element(x[j], d, r)) << (4 * j);
      hi |= uint32_t(encode_element(x[j + 8], d, r)) << (4 * j);
    }
  }
  return make_uint2(lo, hi);
}

// One thread per 16-element block, so the per-block work (amax, scale code,
// reciprocal) is done once. Each thread encodes kUnroll blocks spaced a grid
// apart, all four 16-byte loads issued before any math.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ input, int64_t group_blocks, const float* __restrict__ global_in,
                    const float* __restrict__ amax, uint2* __restrict__ packed, uint8_t* __restrict__ block_scale,
                    float* __restrict__ global_out) {
  const int g = blockIdx.y;
  const int64_t base = g * group_blocks;  // first block of this group
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t b0 = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  float x[kUnroll][kBlockSize];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t b = b0 + u * stride;
    const T* p = input + (base + (b < group_blocks ? b : 0)) * kBlockSize;
    float lo[8], hi[8];
    cuda::load8(p, lo);
    cuda::load8(p + 8, hi);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      x[u][j] = lo[j];
      x[u][j + 8] = hi[j];
    }
  }
  const float s = global_in ? global_in[g] : global_scale_from_amax(amax[g]);
  if (b0 == 0) global_out[g] = s;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t b = b0 + u * stride;
    if (b >= group_blocks) break;
    float m = 0.f;
#pragma unroll
    for (int j = 0; j < kBlockSize; ++j) m = nan_propagating_absmax(m, x[u][j]);
    const uint8_t scale = encode_block_scale(m, s);
    const float d = s * e4m3_to_float(scale);
    packed[base + b] = encode_block(x[u], m, d, reciprocal_rn(d));
    block_scale[base + b] = scale;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint32_t* __restrict__ packed, const uint8_t* __restrict__ block_scale,
                      const float* __restrict__ global_scale, int64_t group_chunks, T* __restrict__ out) {
  const int64_t c = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= group_chunks) return;
  const int64_t i = blockIdx.y * group_chunks + c;
  const uint32_t codes = __ldg(packed + i);
  const float b = e4m3_to_float(__ldg(block_scale + (i >> 1)));
  const float s = __ldg(global_scale + blockIdx.y);
  float y[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) y[j] = decode_element((codes >> (4 * j)) & 0xfu, b, s);
  cuda::store8(out + i * kChunk, y);
}

template <typename T>
cudaError_t quantize_typed(const QuantizeArgs& a, cudaStream_t stream) {
  const int64_t group_chunks = a.rows * a.cols / kChunk;
  const T* in = static_cast<const T*>(a.input);
  if (a.groups == 0) return cudaSuccess;
  if (a.groups > cuda::kMaxGridDimYZ) return cudaErrorInvalidValue;  // grid.y limit; the binding rejects this first
  if (group_chunks == 0) {
    if (a.global_scale_in)
      return cudaMemcpyAsync(a.global_scale_out, a.global_scale_in, a.groups * sizeof(float),
                             cudaMemcpyDeviceToDevice, stream);
    return cudaMemsetAsync(a.global_scale_out, 0, a.groups * sizeof(float), stream);  // amax of nothing is 0
  }
  if (!a.global_scale_in) {
    cudaError_t err = cudaMemsetAsync(a.amax_workspace, 0, a.groups * sizeof(float), stream);
    if (err != cudaSuccess) return err;
    const int64_t needed = cuda::ceil_div(group_chunks, kThreads * 4);
    const int64_t target = cuda::ceil_div(int64_t(cuda::num_sms()) * 8, a.groups);
    dim3 grid(static_cast<unsigned>(needed < target ? needed : target), static_cast<unsigned>(a.groups));
    amax_kernel<T><<<grid, kThreads, 0, stream>>>(in, group_chunks, a.amax_workspace);
  }
  const int64_t group_blocks = group_chunks / 2;
  dim3 grid(static_cast<unsigned>(cuda::ceil_div(group_blocks, kThreads * kUnroll)), static_cast<unsigned>(a.groups));
  quantize_kernel<T><<<grid, kThreads, 0, stream>>>(in, group_blocks, a.global_scale_in, a.amax_workspace,
                                                    reinterpret_cast<uint2*>(a.packed), a.block_scale,
                                                    a.global_scale_out);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dequantize_typed(const DequantizeArgs& a, cudaStream_t stream) {
  const int64_t group_chunks = a.rows * a.cols / kChunk;
  if (a.groups == 0 || group_chunks == 0) return cudaSuccess;
  if (a.groups > cuda::kMaxGridDimYZ) return cudaErrorInvalidValue;
  dim3 grid(static_cast<unsigned>(cuda::ceil_div(group_chunks, kThreads)), static_cast<unsigned>(a.groups));
  dequantize_kernel<T><<<grid, kThreads, 0, stream>>>(reinterpret_cast<const uint32_t*>(a.packed), a.block_scale,
                                                      a.global_scale, group_chunks, static_cast<T*>(a.output));
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
