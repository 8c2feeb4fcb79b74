// CUDA kernels of the NVFP4 Linear: prepack, unpack (dequantize the prepacked
// weight, used by the large-M path: unpack + cuBLAS in the binding), and the
// fused small-M GEMM.
//
// Fused small-M GEMM (M <= kFusedMaxM): one CTA of 8 warps per 16-row tile of
// W (and per split of K, and per 16 rows of x), built from the decode + mma
// main loop of nvfp4_mma.cuh; the weight is read once, in 1 KB coalesced
// pieces, by all SMs at once. The warps' partial sums are added in a fixed
// order in shared memory; with one split the CTA applies global * 2^8 and the
// bias and writes the output, otherwise it writes an FP32 partial and a
// second kernel adds the splits in order (deterministic: no atomics).
#include "lowbit/cuda_utils.cuh"
#include "lowbit/nvfp4_gemm.h"
#include "lowbit/nvfp4_gemm_layout.h"
#include "lowbit/nvfp4_mma.cuh"

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

using mma::kThreads;
using mma::kWarps;

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
  uint32_t a[4];
  mma::decode_fragment<__nv_bfloat16>(word, sw, kt, a);
  const float g = __ldg(global_scale) * kDecodeUnscale;
  const uint32_t lo[2] = {a[0], a[2]};  // row g
  const uint32_t hi[2] = {a[1], a[3]};  // row g + 8
  float v_lo[4], v_hi[4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    v_lo[2 * j] = __uint_as_float(lo[j] << 16) * g;
    v_lo[2 * j + 1] = __uint_as_float(lo[j] & 0xffff0000u) * g;
    v_hi[2 * j] = __uint_as_float(hi[j] << 16) * g;
    v_hi[2 * j + 1] = __uint_as_float(hi[j] & 0xffff0000u) * g;
  }
  cuda::store4(out + row * k + col, v_lo);
  cuda::store4(out + (row + 8) * k + col, v_hi);
}

// grid: (ceil(M / (8 MT)), N / 16, splits). Output tile: 16 rows of W x 8 MT
// rows of x.
// ---- fused small-M GEMM -------------------------------------------------------

template <typename T, int MT>
__global__ void __launch_bounds__(kThreads, mma::kMinBlocks<MT>) linear_fused_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ weight, const uint8_t* __restrict__ scale,
    const float* __restrict__ global_scale, const T* __restrict__ bias, T* __restrict__ out,
    float* __restrict__ workspace, int64_t m, int64_t n, int64_t k, int64_t tiles_per_split) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t m0 = int64_t(blockIdx.x) * 8 * MT;
  const int64_t nt = blockIdx.y;
  const int64_t tiles_k = padded_k(k) / kTileK;
  const int64_t kc_begin = int64_t(blockIdx.z) * tiles_per_split;
  const int64_t kc_end = min(tiles_k, kc_begin + tiles_per_split);
  const uint4* wbase = reinterpret_cast<const uint4*>(weight) + nt * tiles_k * (kTileBytes / 16);
  const uint4* sbase = reinterpret_cast<const uint4*>(scale) + nt * tiles_k * (kTileScaleBytes / 16);

  const T* xrow[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int64_t row = min(m0 + mt * 8 + lane / 4, m - 1);  // rows past M: computed, never stored
    xrow[mt] = x + row * k + (lane % 4) * 4;
  }
  float acc[MT][4];
  mma::warp_mainloop<T, MT>(acc, wbase, sbase, xrow, k, kc_begin, kc_end, warp, lane);

  __shared__ mma::CtaPartials<MT> partial;
  partial.store(acc, warp, lane);
  __syncthreads();
  for (int e = threadIdx.x; e < 16 * 8 * MT; e += kThreads) {
    const int r = e % 16, mc = e / 16;  // r: row of the W tile, mc: row of x in the CTA
    const int64_t row = m0 + mc, o = nt * 16 + r;
    if (row >= m) continue;
    const float sum = partial.sum(r, mc);
    if (gridDim.z == 1) {
      float y = sum * (__ldg(global_scale) * kDecodeUnscale);
      if (bias) y += cuda::to_float(bias[o]);
      out[row * n + o] = cuda::from_float<T>(y);
    } else {
      workspace[(int64_t(blockIdx.z) * m + row) * n + o] = sum;
    }
  }
}

template <typename T>
__global__ void split_reduce_kernel(const float* __restrict__ workspace, int64_t splits, int64_t m, int64_t n,
                                    const float* __restrict__ global_scale, const T* __restrict__ bias,
                                    T* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m * n) return;
  float sum = 0.f;
  for (int64_t s = 0; s < splits; ++s) sum += workspace[s * m * n + i];
  float y = sum * (__ldg(global_scale) * kDecodeUnscale);
  if (bias) y += cuda::to_float(bias[i % n]);
  out[i] = cuda::from_float<T>(y);
}

template <typename T, int MT>
cudaError_t launch_fused(const LinearArgs& a, int64_t splits, cudaStream_t stream) {
  const int64_t tiles_k = padded_k(a.k) / kTileK;
  const int64_t per_split = cuda::ceil_div(tiles_k, splits);
  dim3 grid(static_cast<unsigned>(cuda::ceil_div(a.m, 8 * MT)), static_cast<unsigned>(a.n / kTileN),
            static_cast<unsigned>(splits));
  linear_fused_kernel<T, MT><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(a.x), a.weight, a.scale, a.global_scale, static_cast<const T*>(a.bias),
      static_cast<T*>(a.out), a.workspace, a.m, a.n, a.k, per_split);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || splits == 1) return err;
  split_reduce_kernel<T><<<cuda::ceil_div(a.m * a.n, 256), 256, 0, stream>>>(
      a.workspace, splits, a.m, a.n, a.global_scale, static_cast<const T*>(a.bias), static_cast<T*>(a.out));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fused_typed(const LinearArgs& a, int64_t splits, cudaStream_t stream) {
  if (a.m <= 8) return launch_fused<T, 1>(a, splits, stream);
  return launch_fused<T, 2>(a, splits, stream);
}

}  // namespace

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

int64_t fused_splits(int64_t m, int64_t n, int64_t k) {
  // At least one CTA per SM (they hold 8 warps each, 2-3 fit on an SM); no
  // split when the N tiles alone give that, which saves the reduce kernel.
  const int64_t tiles_k = padded_k(k) / kTileK;
  const int64_t ctas = cuda::ceil_div(m, m <= 8 ? 8 : 16) * (n / kTileN);
  const int64_t target = int64_t(cuda::num_sms());
  int64_t splits = ctas >= target ? 1 : cuda::ceil_div(target, ctas);
  // each warp of a split should get at least one tile
  const int64_t max_splits = tiles_k / kWarps > 1 ? tiles_k / kWarps : 1;
  if (splits > max_splits) splits = max_splits;
  // no empty split
  const int64_t per = cuda::ceil_div(tiles_k, splits);
  return cuda::ceil_div(tiles_k, per);
}

cudaError_t linear_fused_cuda(const LinearArgs& a, int64_t splits, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return cudaSuccess;
  if (a.dtype == DType::kBFloat16) return launch_fused_typed<__nv_bfloat16>(a, splits, stream);
  if (a.dtype == DType::kFloat16) return launch_fused_typed<__half>(a, splits, stream);
  return cudaErrorInvalidValue;
}

}  // namespace lowbit::nvfp4::gemm
