// The NVFP4 Linear on CUDA: prepack and unpack (dequantize the prepacked
// weight; the largest-M path unpacks + cuBLAS in the binding), the split
// reduce that adds the forms' FP32 partials, and linear_fused_cuda, which
// runs a plan (sm90_linear_plan.h: which form runs where) on the kernel
// forms of sm90_linear_*.cu. All forms apply global * 2^8 and the bias in
// the epilogue when K is not split; otherwise they write FP32 partials that
// split_reduce_kernel, launched as a programmatic dependent, adds in split
// order (deterministic: no atomics), or add the splits in a cluster.
#include <cstdint>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "lowbit/linear/nvfp4_decode.cuh"
#include "lowbit/linear/sm90_linear_forms.cuh"

namespace lowbit::nvfp4::gemm {
namespace {

// ---- prepack / unpack ---------------------------------------------------------

// One thread per (row, 16-column block): encodes the block's scale and ORs
// its 16 codes into the lane words. Blocks never share bits of a word but do
// share words (a word holds codes of two rows), hence the atomicOr.
__global__ void prepack_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ block_scale, int64_t n,
                               int64_t k, int64_t kp, uint32_t* __restrict__ weight, uint8_t* __restrict__ scale) {
  const int64_t blocks = k / 16;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * blocks) return;
  const int64_t row = i / blocks, b = i % blocks;
  const ScaleCode s = encode_scale(block_scale[i]);
  scale[element_pos(row, b * 16, kp).scale_byte] = s.byte;
  for (int64_t kk = b * 16; kk < b * 16 + 16; ++kk) {
    uint32_t code = (codes[row * (k / 2) + kk / 2] >> (4 * (kk & 1))) & 0xfu;
    if (s.zero) code = 0;
    if (s.negative) code ^= 8u;
    const ElementPos p = element_pos(row, kk, kp);
    const uint32_t bits = ((code & 7u) << p.slot.mag) | ((code >> 3) << p.slot.sign);
    if (bits) atomicOr(weight + p.word_byte / 4, bits);
  }
}

__global__ void fill_scale_kernel(uint8_t* __restrict__ scale, int64_t count, uint8_t value) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) scale[i] = value;
}

// Unpack: one thread per lane word (8 codes of two rows in one k-tile),
// decoded exactly as the GEMM does (e2m1 * scale * 2^-8 in bf16), then
// * global * 2^8 in FP32 and one rounding to T; each row's 4 values are
// consecutive columns (the K permutation of the layout), one 8-byte store.
template <typename T>
__global__ void unpack_kernel(const uint32_t* __restrict__ weight, const uint8_t* __restrict__ scale,
                              const float* __restrict__ global_scale, int64_t n, int64_t k, int64_t kp,
                              T* __restrict__ out) {
  const int64_t words = n * kp / 8;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= words) return;
  const int64_t tile = i / 256;
  const int within = static_cast<int>(i % 256);
  const int half = within / 128, lane = (within % 128) / 4, kt = half * 4 + within % 4;
  const int64_t tiles_k = kp / kTileK;
  const int64_t col = (tile % tiles_k) * kTileK + kt * 16 + (lane % 4) * 4;
  if (col >= k) return;
  const int64_t row = (tile / tiles_k) * kTileN + lane / 4;
  const uint32_t word = __ldg(weight + i);
  const uint32_t sw = __ldg(reinterpret_cast<const uint32_t*>(scale + tile * kTileScaleBytes + (lane / 4) * 16) + kt / 2);
  float v_lo[4], v_hi[4];  // rows g and g + 8
  mma::decode_word_rows(word, sw, kt, v_lo, v_hi);
  const float g = __ldg(global_scale) * kDecodeUnscale;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v_lo[j] *= g;
    v_hi[j] *= g;
  }
  cuda::store4(out + row * k + col, v_lo);
  cuda::store4(out + (row + 8) * k + col, v_hi);
}

// out = sum over splits of partials [splits, M, N], in split order, * global
// + bias; a thread per 4 consecutive outputs (N is a multiple of 16). The
// loads of 8 splits are all in flight before the first add: one round trip
// to L2 per 8 splits, not per split.
template <typename T>
__global__ void split_reduce_kernel(const float* partials, int64_t splits, int64_t m, int64_t n,
                                    cuda::ReadOnly<float> global_scale, cuda::ReadOnly<T> bias,
                                    T* __restrict__ out) {
  constexpr int kBatch = 8;
  cuda::allow_dependent_launch();  // the next kernel's prologue (its first W copies) overlaps this one
  cuda::wait_for_previous_grid();
  const int64_t i = 4 * (int64_t(blockIdx.x) * blockDim.x + threadIdx.x), outputs = m * n;
  if (i >= outputs) return;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t s0 = 0; s0 < splits; s0 += kBatch) {
    float4 part[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (s0 + b < splits) part[b] = *reinterpret_cast<const float4*>(partials + (s0 + b) * outputs + i);
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (s0 + b < splits) {
        v[0] += part[b].x;
        v[1] += part[b].y;
        v[2] += part[b].z;
        v[3] += part[b].w;
      }
  }
  const float scale = __ldg(global_scale) * kDecodeUnscale;
  const int64_t o = i % n;
#pragma unroll
  for (int e = 0; e < 4; ++e) v[e] = v[e] * scale + (bias ? cuda::to_float(bias[o + e]) : 0.f);
  cuda::store4(out + i, v);
}

template <typename T>
cudaError_t launch_typed(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  switch (p.path) {
    case LinearPath::kStream:
      // Stream-K: one W tile per warp only.
      if (p.stream_k_ctas > 0 && p.stream_tiles != 2) return launch_linear_stream_k<T>(a, p, stream);
      return launch_linear_stream<T>(a, p, stream);
    case LinearPath::kNarrow:
      return launch_linear_narrow<T>(a, p, stream);
    case LinearPath::kWide:
      return launch_linear_wide<T>(a, p, stream);
    case LinearPath::kWgmma:
      return linear_wgmma_cuda(a, p, stream);
    case LinearPath::kPanel:
      return launch_linear_panel<T>(a, p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

template <typename T>
cudaError_t launch_split_reduce(const LinearArgs& a, int64_t splits, cudaStream_t stream) {
  const dim3 grid(unsigned(cuda::ceil_div(a.m * a.n, 4 * 256)));
  return cuda::launch_dependent(split_reduce_kernel<T>, grid, dim3(256), 0, stream,
                                static_cast<const float*>(a.workspace), splits, a.m, a.n, a.global_scale,
                                static_cast<const T*>(a.bias), static_cast<T*>(a.out));
}

template cudaError_t launch_split_reduce<__nv_bfloat16>(const LinearArgs&, int64_t, cudaStream_t);
template cudaError_t launch_split_reduce<__half>(const LinearArgs&, int64_t, cudaStream_t);

cudaError_t prepack_cuda(const PrepackArgs& a, cudaStream_t stream) {
  const int64_t kp = padded_k(a.k);
  if (a.n == 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(a.weight, 0, a.n * kp / 2, stream);
  if (err != cudaSuccess) return err;
  const int64_t scale_bytes = a.n * kp / 16;
  fill_scale_kernel<<<cuda::ceil_div(scale_bytes, 256), 256, 0, stream>>>(a.scale, scale_bytes,
                                                                          encode_scale(0x38).byte);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  const int64_t blocks = a.n * (a.k / 16);
  if (blocks == 0) return cudaSuccess;
  prepack_kernel<<<cuda::ceil_div(blocks, 256), 256, 0, stream>>>(a.codes, a.block_scale, a.n, a.k, kp,
                                                                  reinterpret_cast<uint32_t*>(a.weight), a.scale);
  return cudaGetLastError();
}

cudaError_t unpack_cuda(const UnpackArgs& a, cudaStream_t stream) {
  const int64_t kp = padded_k(a.k);
  const int64_t count = a.n * kp / 8;
  if (count == 0 || a.k == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(cuda::ceil_div(count, 256));
  switch (a.out_dtype) {
    case DType::kBFloat16:
      unpack_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(a.weight), a.scale, a.global_scale, a.n, a.k, kp,
                                                             static_cast<__nv_bfloat16*>(a.out));
      break;
    case DType::kFloat16:
      unpack_kernel<__half><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(a.weight), a.scale, a.global_scale, a.n, a.k, kp,
                                                      static_cast<__half*>(a.out));
      break;
    case DType::kFloat32:
      unpack_kernel<float><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(a.weight), a.scale, a.global_scale, a.n, a.k, kp,
                                                     static_cast<float*>(a.out));
      break;
  }
  return cudaGetLastError();
}

cudaError_t linear_fused_cuda(const LinearArgs& a, const LinearPlan& plan, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return cudaSuccess;
  if (a.dtype == DType::kBFloat16) return launch_typed<__nv_bfloat16>(a, plan, stream);
  if (a.dtype == DType::kFloat16) return launch_typed<__half>(a, plan, stream);
  return cudaErrorInvalidValue;
}

}  // namespace lowbit::nvfp4::gemm
